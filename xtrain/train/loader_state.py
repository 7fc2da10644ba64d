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


# what a training's state.pt holds (Lightning's checkpoint dict, its tensors replaced by
# references), all read by Lightning's restore
TRAINING_FIELDS = {"global_step": int, "state_dict": dict, "optimizer_states": list, "loops": dict,
                   "callbacks": dict}


def check_saved_position(checkpoint: str, steps: StepBatches) -> None:
    """Refuse to resume from ``checkpoint`` when its ``state.pt`` is not a training's, or when
    ``steps`` cannot continue from its data position (other data, seed or processes), from that
    file alone: Lightning restores the position after reading every tensor (minutes, for a large
    model on gs://)."""
    from xtrain.checkpoint.io import read_plain_state
    from xtrain.checkpoint.layout import lacks
    from xtrain.data.loader import POSITION_FIELDS
    from xtrain.errors import CheckpointError

    def refuse(what: str, why: str):
        raise CheckpointError(f"checkpoint {checkpoint}: {what} holds {why}: not a training state "
                              "xtrain saved, it cannot be resumed from")

    state = read_plain_state(checkpoint)
    if why := lacks(state, TRAINING_FIELDS):
        refuse("state.pt", why)
    saved = state["callbacks"].get(LoaderState.__qualname__)  # (Lightning's default key)
    if saved is not None:
        position = saved.get("loader") if isinstance(saved, dict) else saved
        if why := lacks(position, POSITION_FIELDS):
            refuse("state.pt's data position", why)
        steps.check_position(position)
