"""Lightning plugins for torch_xla SPMD: accelerator, strategy and precision.

Lightning 2.6 has no SPMD strategy (its XLAStrategy spawns one process per device) and its
``XLAAccelerator.is_available()`` crashes off-TPU, so xtrain brings its own set:

- :class:`SPMDAccelerator`: an XLA accelerator that is available wherever torch_xla's runtime is
  (TPU, or CPU PJRT with virtual devices).
- :class:`SPMDStrategy`: one process per host; moves the module to the XLA device, shards its
  parameters by the ``parallelism`` rules, assembles every batch from the hosts' rows (torch_xla's
  per-host input sharding), takes rank, world, ``is_global_zero``, barriers, broadcasts and
  votes from the run's processes (xtrain/engines/processes.py: torch_xla's process index and
  count, gloo across hosts) so side effects happen once, and saves and loads checkpoints shard
  by shard through xtrain's fsspec CheckpointIO (DCP, every host its own).
- :class:`SPMDPrecision`: runs ``optimizer.step(closure)`` — every micro-batch's forward and
  backward, clipping and the update — inside one ``torch_xla.compile`` region, so a step is one
  graph, reused at every step after warm-up.
"""

from __future__ import annotations

import lightning as L
import torch
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import SingleDeviceStrategy

from xtrain import compat
from xtrain.errors import warn


class SPMDAccelerator(Accelerator):
    """Not an ``XLAAccelerator`` subclass: Lightning pairs those with its spawn-based strategies."""

    @staticmethod
    def is_available() -> bool:
        return True

    @staticmethod
    def name() -> str:
        return "xla_spmd"

    def teardown(self) -> None:
        pass

    @staticmethod
    def auto_device_count() -> int:
        return 1  # one SPMD "device" per process: the mesh spans the real ones

    @staticmethod
    def parse_devices(devices) -> int:
        return 1

    @staticmethod
    def get_parallel_devices(devices) -> list:
        import torch_xla

        return [torch_xla.device()]

    def setup_device(self, device: torch.device) -> None:
        pass

    def get_device_stats(self, device) -> dict:
        return {}


class SPMDPrecision(Precision):
    def optimizer_step(self, optimizer, model, closure, **kwargs):
        import torch_xla

        # No max_different_graphs guard: torch_xla counts graphs per compiled function object, and
        # Lightning hands us a new closure each step. Recompiles are caught by the tests instead
        # (tests/test_xla.py: 3 compilations per run, the same for 50 and 100 steps).
        closure = compat.wrap_closure(self, model, optimizer, closure)
        return torch_xla.compile(lambda: optimizer.step(closure=closure, **kwargs), full_graph=True,
                                 name="xtrain_train_step")()


class SPMDStrategy(SingleDeviceStrategy):
    """Lightning's single-device strategy (one SPMD "device" per process) with the multi-host
    answers Lightning and xtrain ask for: SingleDeviceStrategy's own are those of a lone process
    (always global zero, barriers and broadcasts that do nothing).

    ``processes``: the run's processes (None: this one alone); ``per_host``: each host feeds only
    its own rows (see xtrain/xla/spmd.py, ``batch_to_device``)."""

    def __init__(self, mesh, rules, processes=None, per_host: bool = True, checkpoint_io=None,
                 precision_plugin=None):
        import torch_xla

        from xtrain.engines.processes import Processes

        super().__init__(device=torch_xla.device(), accelerator=SPMDAccelerator(),
                         checkpoint_io=checkpoint_io, precision_plugin=precision_plugin or SPMDPrecision())
        self.mesh, self.rules, self.per_host = mesh, rules, per_host
        self.processes = processes or Processes()
        self.param_specs: dict = {}
        self.param_shardings: dict = {}
        # one process per host: rank 0 (the first host) does the side effects
        self.global_rank, self.world_size = self.processes.rank, self.processes.world

    @property
    def is_global_zero(self) -> bool:
        return self.processes.primary

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        """Resume after setup (Lightning's default is before): :meth:`load_checkpoint` reads into
        the model and optimizer state once they are sharded on the devices. Before setup the
        model is a whole CPU copy and no optimizer exists, so every host read the whole
        checkpoint, and the optimizer state reached the devices unsharded (a full copy per chip)
        until training started."""
        return True

    def teardown(self) -> None:
        """Lightning's, without its move of the model and optimizer state to the CPU: that
        gathers each sharded tensor whole onto every host (a compile and a transfer per tensor),
        after every fit, inside a preemption's notice too. The state stays on the devices, where
        a validation after fit (xtrain/train/finish.py) finds it, until the process ends."""
        self.precision_plugin.teardown()
        self.accelerator.teardown()
        self.checkpoint_io.teardown()

    def setup_environment(self) -> None:
        from lightning.pytorch.utilities.rank_zero import rank_zero_only
        from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only

        super().setup_environment()
        # Lightning's rank_zero_* helpers print on host 0 only (as its DDP strategy arranges)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank

    def barrier(self, *args, **kwargs) -> None:
        self.processes.barrier()

    def broadcast(self, obj, src: int = 0):
        return self.processes.broadcast(obj, src)

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        """A host-side decision agreed by every host: all of them (``all``) or any of them."""
        if all:
            return not self.processes.vote(not decision)()
        return bool(self.processes.vote(decision)())

    def model_to_device(self) -> None:
        from xtrain.xla.layers import install_layer_loop
        from xtrain.xla.spmd import set_attention_partition, shard_parameters

        self.model.to(self.root_device)
        model = self.lightning_module.model
        self.param_specs = shard_parameters(model, self.rules, self.mesh)
        set_attention_partition(model)
        install_layer_loop(model, self.param_specs, self.mesh)

    def batch_to_device(self, batch, device=None, dataloader_idx=0):
        """Host rows to the mesh (the module has no batch-transfer hooks to run)."""
        from xtrain.xla.spmd import batch_to_device

        if isinstance(batch, (tuple, list)):  # training: (tokens, loader state)
            return (batch_to_device(batch[0], self.mesh, self.per_host), *batch[1:])
        return batch_to_device(batch, self.mesh, self.per_host)

    def _init_optimizer_state(self) -> None:
        """Create missing optimizer state on the device, sharded like its parameters."""
        from xtrain.xla.spmd import mark, optimizer_state_specs

        for opt in self.optimizers:
            opt.init_state()
            for buf, spec in optimizer_state_specs(opt, self.lightning_module.model, self.param_specs):
                mark(buf, self.mesh, spec)

    def on_train_start(self) -> None:
        """Create the optimizer state now, so the first step's graph is every step's graph."""
        import torch_xla

        from xtrain.xla.spmd import sharding_specs

        self._init_optimizer_state()
        torch_xla.sync()
        self.param_shardings = sharding_specs(self.lightning_module.model)  # what XLA holds

    def on_validation_start(self) -> None:
        from xtrain.xla.spmd import mark

        mark(self.lightning_module._val_sums, self.mesh, None)

    def validation_step(self, *args, **kwargs):
        import torch_xla

        out = super().validation_step(*args, **kwargs)
        torch_xla.sync()  # cut the graph per batch: one small graph reused, not one growing one
        return out

    def save_checkpoint(self, checkpoint, filepath, storage_options=None) -> None:
        # every host writes its own shards (the CheckpointIO is sharded; see xtrain/checkpoint/io.py)
        self.checkpoint_io.save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    def load_checkpoint(self, checkpoint_path, weights_only=None) -> dict:
        """Read the model's and optimizer's tensors straight into their sharded device tensors
        (each host reads only the shards its devices hold)."""
        import torch_xla

        from xtrain.checkpoint.io import split_tensors

        self._init_optimizer_state()
        torch_xla.sync()
        target = {"state_dict": self.lightning_module.state_dict(),
                  "optimizer_states": [opt.state_dict() for opt in self.optimizers]}
        _, tensors = split_tensors(target)
        return self.checkpoint_io.load_checkpoint(checkpoint_path, targets=tensors)


class CompileCacheSync(L.Callback):
    """After the first training step (the step's graph), when training ends (the validation
    step's) and when it stops (a preemption during the first compile leaves the compiled step
    for the next VM): say what the persistent compile cache (xtrain/xla/compile_cache.py) did,
    and push new entries to its mirror, if it has one (the first host pushes: every host
    compiles the same programs). A push that fails costs a warning: the cache only saves time."""

    def __init__(self, cache, rank: int):
        self.cache, self.rank, self.reported_first = cache, rank, False

    def _sync(self, when: str) -> None:
        from xtrain.xla.compile_cache import cache_counters, describe_counters

        print(f"XLA compile cache ({when}): {describe_counters(cache_counters())}", flush=True)
        if self.rank == 0 and self.cache.remote is not None:
            try:
                n = self.cache.push()
            except Exception as e:  # noqa: BLE001  (storage errors come in many types)
                warn(f"compile cache entries not pushed to {self.cache.remote} ({type(e).__name__}: "
                     f"{e}); pushed at the next sync")
                return
            print(f"XLA compile cache: {n} new entries pushed to {self.cache.remote}", flush=True)

    def on_train_batch_end(self, *args) -> None:
        if not self.reported_first:
            self.reported_first = True
            self._sync("after the first step")

    def on_train_end(self, *args) -> None:
        self._sync("end of training")

    def on_exception(self, *args) -> None:
        self._sync("training stopped")
