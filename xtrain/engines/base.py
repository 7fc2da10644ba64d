"""What differs between engines, behind one small interface: the Trainer's device plugins, this
host's share of the batch, how checkpoints are written, and reading device values for logs."""

from __future__ import annotations

from xtrain.checkpoint.async_io import FsspecCheckpointIO


class Engine:
    """The CPU engine's behaviour is the default; the XLA engine (xtrain/xla/engine.py) overrides.

    ``rank``/``world``: this process's index among the run's processes (one per host).
    ``rows_per_host``: rows of one micro-batch this process loads.
    """

    name = "base"

    def __init__(self, plan):
        self.rank, self.world = 0, 1
        self.plan = plan

    @property
    def rows_per_host(self) -> int:
        return self.plan.batch.device_batch_size * self.plan.batch.data_parallel // self.world

    def checkpoint_io(self, retries: int) -> FsspecCheckpointIO:
        return FsspecCheckpointIO(retries=retries)

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

    def counters(self) -> dict:
        """Engine counters for the metrics (e.g. XLA compilations)."""
        return {}

    def summary(self) -> dict:
        """Facts for the run's summary (e.g. how XLA sharded each parameter)."""
        return {}
