"""The XLA engine: torch_xla SPMD, one process per host driving every device of the slice."""

from __future__ import annotations

from xtrain import compat
from xtrain.checkpoint.async_io import FsspecCheckpointIO
from xtrain.engines.base import Engine


class XLAEngine(Engine):
    name = "xla"

    def __init__(self, hardware, parallelism, plan, compile_analysis: str | None = None,
                 compile_cache=None):
        """``compile_analysis``: a file for torch_xla's explanation of every compilation (the
        recompilation guard reads it); None: not collected. ``compile_cache``: the
        CompileCacheConfig (xtrain/xla/compile_cache.py)."""
        super().__init__(plan)
        from xtrain.xla.runtime import start_runtime
        from xtrain.xla.spmd import build_mesh

        self.compile_analysis = compile_analysis
        self.compile_cache = start_runtime(hardware, compile_analysis, compile_cache)
        import torch_xla.runtime as xr

        self.rank, self.world = xr.process_index(), xr.process_count()
        self.mesh = build_mesh(plan.mesh)
        self.rules = parallelism.rules
        self.strategy = None

    def checkpoint_io(self, retries: int) -> FsspecCheckpointIO:
        import torch.distributed as dist

        group = dist.group.WORLD if dist.is_initialized() else None
        # every host writes and reads its own shards
        return FsspecCheckpointIO(retries=retries, sharded=True, rank=self.rank, process_group=group)

    def trainer_kwargs(self, checkpoint_io) -> dict:
        from xtrain.xla.lightning import SPMDStrategy

        self.strategy = SPMDStrategy(self.mesh, self.rules, checkpoint_io=checkpoint_io)
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

    def counters(self) -> dict:
        from xtrain.xla.spmd import counters

        return counters()

    def summary(self) -> dict:
        """name -> the HLO sharding XLA held for each parameter."""
        return {"param_shardings": self.strategy.param_shardings}
