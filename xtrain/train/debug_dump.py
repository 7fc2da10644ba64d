"""``XTRAIN_DEBUG_DUMP=DIR``: every process saves ``DIR/rank<r>.pt`` at the end of training with
its final parameters, the rows of each micro-batch it kept and its first step's tokens.

For tests of multi-process runs (tests/test_multiprocess.py): DDP keeps a full replica of the
parameters on every process, and the checkpoint cannot show that they agree (DCP writes each
replicated tensor once, from one process). Off unless the variable is set.
"""

from __future__ import annotations

import os

import lightning as L
import torch

ENV = "XTRAIN_DEBUG_DUMP"


def debug_dump(rank: int, rows: slice) -> L.Callback | None:
    directory = os.environ.get(ENV)
    return DebugDump(os.path.join(directory, f"rank{rank}.pt"), rows) if directory else None


class DebugDump(L.Callback):
    def __init__(self, path: str, rows: slice):
        self.path, self.rows, self.first_tokens = path, rows, None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.first_tokens is None:
            self.first_tokens = batch[0].detach().to("cpu", copy=True)

    def on_train_end(self, trainer, pl_module):
        params = {k: v.detach().cpu() for k, v in pl_module.model.state_dict().items()}
        torch.save({"params": params, "rows": [self.rows.start, self.rows.stop],
                    "first_tokens": self.first_tokens, "step": trainer.global_step}, self.path)
