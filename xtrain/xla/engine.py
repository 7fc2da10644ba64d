"""The XLA engine: torch_xla SPMD, one process per host driving every device of its host; the
mesh spans every host's devices."""

from __future__ import annotations

from xtrain import compat
from xtrain.checkpoint.async_io import FsspecCheckpointIO
from xtrain.engines.base import Engine
from xtrain.parallelism import per_host_batch


class XLAEngine(Engine):
    name = "xla"

    def __init__(self, hardware, parallelism, plan, timeout_s: float,
                 compile_analysis: str | None = None, compile_cache=None):
        """``timeout_s``: of collectives across hosts; ``compile_analysis``: a file for
        torch_xla's explanation of every compilation (the recompilation guard reads it); None:
        not collected. ``compile_cache``: the CompileCacheConfig (xtrain/xla/compile_cache.py)."""
        from xtrain.xla import runtime
        from xtrain.xla.spmd import build_mesh

        self.compile_analysis = compile_analysis
        self.compile_cache = runtime.start_runtime(hardware, compile_analysis, compile_cache)
        super().__init__(plan, runtime.host_processes(timeout_s))
        self.mesh = build_mesh(plan.mesh)
        self.rules = parallelism.rules
        self.per_host = per_host_batch(plan.mesh)
        self.strategy = None

    @property
    def host_rows(self) -> slice:
        """This host's share, or every row when the batch cannot be fed per host (then each host
        uploads only the rows its devices hold: xtrain/xla/spmd.py)."""
        return super().host_rows if self.per_host else slice(0, self.global_rows)

    @property
    def batch_shares(self) -> int:
        return 1  # the step sees the global array (per-host rows assembled by input sharding)

    def checkpoint_io(self, retries: int) -> FsspecCheckpointIO:
        # every host writes and reads its own shards
        return FsspecCheckpointIO(retries=retries, sharded=True, rank=self.rank,
                                  process_group=self.processes.checkpoint_group,
                                  peer_lost=self.processes.vanished)

    def trainer_kwargs(self, checkpoint_io) -> dict:
        from xtrain.xla.lightning import SPMDStrategy

        self.strategy = SPMDStrategy(self.mesh, self.rules, self.processes, self.per_host,
                                     checkpoint_io=checkpoint_io)
        return {"strategy": self.strategy, "devices": 1}

    def callbacks(self, trainer_cfg, run_dir: str) -> list:
        out = []
        if self.compile_cache is not None:
            from xtrain.xla.lightning import CompileCacheSync

            out.append(CompileCacheSync(self.compile_cache, self.rank))
        if trainer_cfg.max_compiles:
            from xtrain.xla.guard import RecompileGuard

            out.append(RecompileGuard(trainer_cfg.max_compiles, self.compile_analysis))
        return out

    def fetch(self, tensors) -> list[float]:
        return [float(t) for t in compat.tensors_to_cpu(tensors)]

    def devices(self) -> list[dict]:
        import torch_xla.runtime as xr

        return [dict(attrs, index=i) for i, attrs in enumerate(xr.global_runtime_device_attributes())]

    def counters(self) -> dict:
        from xtrain.xla.spmd import counters

        return counters()

    def summary(self) -> dict:
        """name -> the HLO sharding XLA held for each parameter."""
        return {"param_shardings": self.strategy.param_shardings}
