"""Torch-facing views of the loader: optimizer-step batches for training, fixed batches for eval."""

from __future__ import annotations

import numpy as np
import torch

from xtrain.data.loader import PackedLoader


class StepBatches(torch.utils.data.IterableDataset):
    """Yields ``(tokens [accum, rows, T+1], loader_state_after)``: one optimizer step each."""

    def __init__(self, loader: PackedLoader, accum: int):
        super().__init__()
        self.loader, self.accum = loader, accum

    def __iter__(self):
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
