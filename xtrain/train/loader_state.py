"""The Lightning callback that checkpoints the data loader's position, and the check of a saved
position before any tensor of its checkpoint is read."""

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


def check_saved_position(checkpoint: str, steps: StepBatches) -> None:
    """Refuse to resume from ``checkpoint`` when ``steps`` cannot continue from its data position
    (other data, seed or processes), from its ``state.pt`` alone: Lightning restores the
    position after reading every tensor (minutes, for a large model on gs://)."""
    from xtrain.checkpoint.io import read_plain_state

    callbacks = read_plain_state(checkpoint).get("callbacks", {})
    saved = callbacks.get(LoaderState.__qualname__)  # (Lightning's default key of its state)
    if saved is not None:
        steps.check_position(saved["loader"])
