"""torch_xla SPMD: runtime start-up, the device mesh, and the sharding rules applied to a model.

One process per host drives every device of the slice (``xr.use_spmd()``), the way the user
trains today. The rules come from the ``parallelism`` group (validated by
:mod:`xtrain.parallelism`); the model code knows nothing about them.
"""

from __future__ import annotations

import os

import numpy as np

from xtrain.parallelism import AXES, BATCH_AXES, check_rules

_started = False


def start_runtime(hw) -> None:
    """Environment first, then SPMD mode, before any XLA tensor exists (order matters: torch_xla
    reads PJRT_DEVICE and XLA_* once, and use_spmd() must precede the first device tensor)."""
    global _started
    from xtrain.hardware import apply_environment, check_runtime

    if _started:
        return
    apply_environment(hw)
    if not hw.accelerator_type:
        os.environ.setdefault("PJRT_DEVICE", "CPU")  # XLA on CPU PJRT: the test/try-out path
    import torch_xla.runtime as xr

    xr.use_spmd()
    check_runtime(hw)
    if xr.process_count() > 1:
        # a CPU process group across hosts, for coordination outside the compiled graph
        # (untestable here: torch_xla multi-process on CPU does not rendezvous; see DESIGN.md)
        import torch.distributed as dist

        if not dist.is_initialized():
            dist.init_process_group("gloo", init_method="xla://")
    _started = True


def build_mesh(sizes: dict[str, int]):
    import torch_xla.distributed.spmd as xs
    import torch_xla.runtime as xr

    devices = xr.global_runtime_device_count()
    shape = tuple(sizes[a] for a in AXES)
    mesh = xs.Mesh(np.arange(devices), shape, AXES)
    xs.set_global_mesh(mesh)  # the Pallas kernels' SPMD wrappers read the global mesh
    return mesh


def shard_parameters(model, rules, mesh) -> dict[str, tuple | None]:
    """Mark every parameter with the spec of its first matching rule, and the others explicitly
    replicated; returns name -> spec.

    Explicit replication matters: a step's outputs carry a sharding annotation, so inputs without
    one would make the first step a different graph from all later ones.
    """
    sizes = dict(zip(mesh.axis_names, mesh.mesh_shape))
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    specs = check_rules(rules, sizes, shapes)
    for name, p in model.named_parameters():
        mark(p, mesh, specs[name])
    return specs


def mark(tensor, mesh, spec):
    """mark_sharding with ``None`` meaning replicated over every axis."""
    import torch_xla.distributed.spmd as xs

    xs.mark_sharding(tensor, mesh, spec if spec is not None else (None,) * tensor.dim())
    return tensor


def set_attention_partition(model) -> None:
    """The Pallas kernels run per shard: q/k/v [B, H, T, D] split with batch over the batch axes
    and heads over tensor."""
    for block in model.blocks:
        block.attn.partition_spec = (BATCH_AXES, "tensor", None, None)


def optimizer_state_specs(optimizer, model, param_specs: dict):
    """(state tensor, spec) for every optimizer buffer: a buffer shaped like its parameter is
    sharded like it, anything else (the step counter) is replicated."""
    names = {id(p): n for n, p in model.named_parameters()}
    for p, state in optimizer.state.items():
        for buf in state.values():
            yield buf, (param_specs.get(names.get(id(p))) if buf.shape == p.shape else None)
    for counter in optimizer.scalar_state():
        yield counter, None


def batch_spec(ndim: int) -> tuple:
    """[A, B, T+1] (micro-batches) or [B, T+1]: rows split over the batch axes."""
    return (None, BATCH_AXES, None) if ndim == 3 else (BATCH_AXES, None)


def shard_batch(tokens, mesh):
    import torch_xla.distributed.spmd as xs

    xs.mark_sharding(tokens, mesh, batch_spec(tokens.dim()))
    return tokens


def counters() -> dict[str, int]:
    """Cumulative XLA compilations and device-to-host transfers of this process."""
    import torch_xla.debug.metrics as met

    def count(name):
        data = met.metric_data(name)
        return int(data[0]) if data else 0

    return {"xla_compiles": count("CompileTime"), "host_syncs": count("TransferFromDeviceTime")}
