"""What differs between engines, behind one small interface: the Trainer's device plugins, this
process's share of the batch, how checkpoints are written, and reading device values for logs."""

from __future__ import annotations

from xtrain.checkpoint.async_io import FsspecCheckpointIO
from xtrain.engines.processes import Processes


class Engine:
    """The CPU engine's behaviour is the default; the XLA engine (xtrain/xla/engine.py) overrides.

    ``processes``: the run's processes, one per host (:mod:`xtrain.engines.processes`); ``rank``
    and ``world`` come from there and nowhere else, and the Trainer's strategy reports the same.
    """

    name = "base"

    def __init__(self, plan, processes: Processes | None = None):
        self.plan = plan
        self.processes = processes or Processes()

    @property
    def rank(self) -> int:
        return self.processes.rank

    @property
    def world(self) -> int:
        return self.processes.world

    @property
    def global_rows(self) -> int:
        """Rows of one micro-batch over the whole run: every process packs these, in the same
        order whatever the process count (xtrain/data/batches.py)."""
        return self.plan.batch.device_batch_size * self.plan.batch.data_parallel

    @property
    def host_rows(self) -> slice:
        """The rows of every micro-batch this process trains on: process r keeps the r-th
        contiguous share."""
        share = self.global_rows // self.world
        return slice(self.rank * share, (self.rank + 1) * share)

    @property
    def batch_shares(self) -> int:
        """How many processes' batches make up a step's rows, as the training step (and its
        callbacks) see the batch: each process its own share here."""
        return self.world

    def checkpoint_io(self, retries: int) -> FsspecCheckpointIO:
        return FsspecCheckpointIO(retries=retries, rank=self.rank,
                                  process_group=self.processes.checkpoint_group,
                                  peer_lost=self.processes.vanished)

    def trainer_kwargs(self, checkpoint_io) -> dict:
        """Keyword arguments of Lightning's Trainer that place the run on this engine."""
        raise NotImplementedError

    def callbacks(self, trainer_cfg, run_dir: str) -> list:
        """Engine-specific Lightning callbacks (e.g. the XLA recompilation guard,
        compiling the CPU step)."""
        return []

    def fetch(self, tensors) -> list[float]:
        """Device tensors to Python floats, in one device-to-host transfer."""
        return [float(t) for t in tensors]

    def devices(self) -> list[dict]:
        """The devices the run uses, for the reproducibility bundle."""
        import torch

        return [{"type": "cpu", "torch_threads": torch.get_num_threads()}]

    def counters(self) -> dict:
        """Engine counters for the metrics (e.g. XLA compilations)."""
        return {}

    def summary(self) -> dict:
        """Facts for the run's summary (e.g. how XLA sharded each parameter)."""
        return {}
