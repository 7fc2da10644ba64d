"""The CPU engine: plain PyTorch through Lightning's Trainer; on several processes (hosts), Lightning's
DDP over gloo, each process training on its own rows of every step; with ``trainer.compile``, the
step compiled by torch.compile (xtrain/engines/torch_compile.py)."""

from __future__ import annotations

import ctypes
from datetime import timedelta

from lightning.fabric.plugins.environments import ClusterEnvironment
from lightning.pytorch.strategies import DDPStrategy

from xtrain import compat
from xtrain.engines.base import Engine
from xtrain.engines.processes import Processes, join_gloo
from xtrain.engines.torch_compile import TorchCompile
from xtrain.hardware import launch_environment


# glibc's mallopt parameters (malloc.h)
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
LARGEST_MALLOPT_VALUE = 2**31 - 1  # mallopt takes a C int


def keep_freed_memory() -> bool:
    """Keep memory a step frees in the process for the next step. glibc's malloc serves blocks
    above its mmap threshold (at most 32 MiB when adjusted dynamically) with fresh mappings and
    unmaps them on free, so every step's large temporaries (a loss slice's logits, attention
    scores, Muon's stacks) fault their pages in again, 4 KiB at a time: ~4% of the compiled d4
    step of BENCHMARKS.md's cpu_peer in a fresh process (measured when this was added). Raised
    thresholds make them heap blocks that are reused.
    glibc only (a no-op elsewhere); returns whether it applied. Neither PyTorch nor Lightning
    tunes the C allocator; the alternative, preloading jemalloc or tcmalloc, must happen before
    the process starts."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, LARGEST_MALLOPT_VALUE)
                and mallopt(M_TRIM_THRESHOLD, LARGEST_MALLOPT_VALUE))


class CPUEngine(Engine):
    name = "cpu"

    def __init__(self, hardware, plan, timeout_s: float, compile_step: bool = False):
        processes, self.address, self.port = Processes(), None, None
        if plan.hosts > 1:  # joined before anything else, so a missing peer fails fast
            rank, world, self.address, self.port = launch_environment(hardware)
            processes = join_gloo(rank, world, timeout_s, f"{self.address}:{self.port}")
        super().__init__(plan, processes)
        keep_freed_memory()
        self.timeout_s = timeout_s
        self.compile_step = compile_step

    def trainer_kwargs(self, checkpoint_io) -> dict:
        if self.world == 1:
            return {"accelerator": "cpu", "devices": 1, "plugins": [checkpoint_io]}
        strategy = CollectiveCheckpointDDP(
            cluster_environment=JoinedProcesses(self.processes, self.address, self.port),
            checkpoint_io=checkpoint_io, process_group_backend="gloo",
            timeout=timedelta(seconds=self.timeout_s),
            broadcast_buffers=False)  # the buffers (rotary tables, token bytes) never change
        # one device per process, one process per "node": Lightning's global rank is then RANK
        return {"accelerator": "cpu", "devices": 1, "num_nodes": self.world, "strategy": strategy,
                "use_distributed_sampler": False}  # each process picks its rows itself

    def callbacks(self, trainer_cfg, run_dir: str) -> list:
        return [TorchCompile()] if self.compile_step else []

    def counters(self) -> dict:
        return {"torch_compiles": compat.dynamo_graph_count()} if self.compile_step else {}


class CollectiveCheckpointDDP(DDPStrategy):
    """Lightning's DDP, except that every process takes part in saving: checkpoints are written
    with torch.distributed.checkpoint, a collective (Lightning's DDP saves on rank 0 only)."""

    def save_checkpoint(self, checkpoint, filepath, storage_options=None) -> None:
        self.checkpoint_io.save_checkpoint(checkpoint, filepath, storage_options=storage_options)


class JoinedProcesses(ClusterEnvironment):
    """Lightning's view of processes the engine has already joined (xtrain/engines/processes.py),
    so rank and world have one source. Lightning's own environments would either spawn processes
    (without LOCAL_RANK) or expect torchrun's variables only."""

    def __init__(self, processes: Processes, address: str, port: int):
        self.processes, self.address, self.port = processes, address, port

    @property
    def creates_processes_externally(self) -> bool:
        return True

    @property
    def main_address(self) -> str:
        return self.address

    @property
    def main_port(self) -> int:
        return self.port

    @staticmethod
    def detect() -> bool:
        return False

    def world_size(self) -> int:
        return self.processes.world

    def set_world_size(self, size: int) -> None:
        pass  # Lightning computes num_nodes x devices = world: the same number

    def global_rank(self) -> int:
        return self.processes.rank

    def set_global_rank(self, rank: int) -> None:
        pass  # node_rank x 1 + local_rank 0 = rank: the same number

    def local_rank(self) -> int:
        return 0

    def node_rank(self) -> int:
        return self.processes.rank
