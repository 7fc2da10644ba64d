"""Torch-facing views of the loader: optimizer-step batches for training, fixed batches for eval."""

from __future__ import annotations

import numpy as np
import torch

from xtrain.data.loader import PackedLoader


class StepBatches(torch.utils.data.IterableDataset):
    """Yields ``(tokens [accum, rows, T+1], loader_state_after)``: one optimizer step each.
    ``repeat`` > 0 yields the first ``repeat`` steps over and over (overfitting, to debug)."""

    def __init__(self, loader: PackedLoader, accum: int, repeat: int = 0):
        super().__init__()
        self.loader, self.accum, self.repeat = loader, accum, repeat

    def __iter__(self):
        steps = self._steps()
        if not self.repeat:
            yield from steps
            return
        first = [next(steps) for _ in range(self.repeat)]
        while True:
            yield from first

    def _steps(self):
        micro = []
        for batch in self.loader:
            micro.append(batch)
            if len(micro) == self.accum:
                yield torch.from_numpy(np.stack(micro)), self.loader.state_dict()
                micro = []


class EvalBatches(torch.utils.data.IterableDataset):
    """The same first ``limit`` batches of a non-shuffled loader at every evaluation."""

    def __init__(self, loader: PackedLoader, limit: int):
        super().__init__()
        self.loader, self.limit = loader, limit
        self.start = loader.state_dict()

    def __iter__(self):
        self.loader.load_state_dict(self.start)
        for i, batch in enumerate(self.loader):
            if i == self.limit:
                return
            yield torch.from_numpy(batch)
