"""Torch-facing views of the loader: optimizer-step batches for training, fixed batches for eval."""

from __future__ import annotations

import itertools

import numpy as np
import torch

from xtrain.data.loader import PAD, PackedLoader


class StepBatches(torch.utils.data.IterableDataset):
    """Yields ``(tokens [rows, accum, T+1], state_after)``: one optimizer step each, with the
    state to resume after it (:meth:`load_state_dict`).
    ``repeat`` > 0 yields the first ``repeat`` steps over and over (overfitting, to debug); their
    state is the loader's position before them and which of them comes next, so a resumed run
    goes on with the same batches in the same order.

    ``rows``: the rows of every packed micro-batch this process keeps. On several processes each
    one packs the whole global batch, in the same order, and keeps its own rows: the batches then
    do not depend on the process count (a one-process run trains on the same rows), and the
    loader state is the same on every process, so any one of them can checkpoint it."""

    def __init__(self, loader: PackedLoader, accum: int, repeat: int = 0, rows: slice = slice(None)):
        super().__init__()
        self.loader, self.accum, self.repeat, self.rows = loader, accum, repeat, rows
        self.replay_next = 0  # with ``repeat``: the index of the repeated step to yield first

    def state_dict(self) -> dict:
        return {**self.loader.state_dict(), "replay_next": self.replay_next}

    def load_state_dict(self, state: dict) -> None:
        self.loader.load_state_dict(state)
        self.replay_next = state.get("replay_next", 0)

    def check_position(self, state: dict) -> None:
        self.loader.check_position(state)

    def __iter__(self):
        if not self.repeat:
            yield from self._steps()
            return
        start = self.loader.state_dict()
        first = [tokens for tokens, _ in itertools.islice(self._steps(), self.repeat)]
        i = self.replay_next % self.repeat
        while True:
            yield first[i], {**start, "replay_next": (i + 1) % self.repeat}
            i = (i + 1) % self.repeat

    def _steps(self):
        micro = []
        for batch in self.loader:
            micro.append(batch[self.rows])
            if len(micro) == self.accum:
                yield torch.from_numpy(np.stack(micro, axis=1)), self.loader.state_dict()
                micro = []


class EvalBatches(torch.utils.data.IterableDataset):
    """The first ``sequences`` rows of a non-shuffled loader, the same at every evaluation, in
    batches of the loader's rows; the last batch's rows past them are PAD (not scored). The row
    stream does not depend on the batch's rows, so neither do the rows scored: a run on another
    device batch or process count validates on the same data. ``rows`` as in
    :class:`StepBatches`."""

    def __init__(self, loader: PackedLoader, sequences: int, rows: slice = slice(None)):
        super().__init__()
        self.loader, self.sequences, self.rows = loader, sequences, rows
        self.batches = -(-sequences // loader.rows)  # at most: a small split ends sooner
        self.start = loader.state_dict()

    def __iter__(self):
        self.loader.load_state_dict(self.start)
        for i, batch in enumerate(self.loader):
            if i == self.batches:
                return
            scored = self.sequences - i * len(batch)
            if scored < len(batch):
                batch = batch.copy()
                batch[scored:] = PAD
            yield torch.from_numpy(np.ascontiguousarray(batch[self.rows]))
