"""The Lightning callback that checkpoints the data loader's position."""

from __future__ import annotations

import lightning as L

from xtrain.data.batches import StepBatches


class LoaderState(L.Callback):
    """Checkpoints the position after the last *trained* batch (Lightning prefetches ahead): each
    training batch carries the state after it (xtrain/data/batches.py)."""

    def __init__(self, steps: StepBatches):
        self.steps = steps
        self.state = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.state = batch[1]

    def state_dict(self):
        return {"loader": self.state if self.state is not None else self.steps.state_dict()}

    def load_state_dict(self, state_dict):
        self.state = state_dict["loader"]  # until a batch is trained, the resumed position holds
        self.steps.load_state_dict(self.state)
