"""torch_xla SPMD: the device mesh, and the sharding rules applied to a model, its optimizer
state and its batches.

One process per host drives every device of the slice (``xr.use_spmd()``). The rules come from
the ``parallelism`` group (validated by :mod:`xtrain.parallelism`); the model code knows nothing
about them.
"""

from __future__ import annotations

import numpy as np

from xtrain import compat
from xtrain.config import BATCH_AXES, MESH_AXES, TENSOR_AXIS
from xtrain.parallelism import check_rules

def build_mesh(sizes: dict[str, int]):
    import torch_xla.distributed.spmd as xs
    import torch_xla.runtime as xr

    devices = xr.global_runtime_device_count()
    shape = tuple(sizes[a] for a in MESH_AXES)
    mesh = xs.Mesh(np.arange(devices), shape, MESH_AXES)
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
        block.attn.partition_spec = (BATCH_AXES, TENSOR_AXIS, None, None)


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
    """[B, A, T+1] (rows of every micro-batch) or [B, T+1]: rows split over the batch axes."""
    return (BATCH_AXES,) + (None,) * (ndim - 1)


def batch_to_device(tokens, mesh, per_host: bool):
    """A CPU batch onto the mesh, rows split over the batch axes, in one transfer.

    ``per_host``: ``tokens`` are this host's rows, and torch_xla's per-host input sharding
    (``ShardingSpec(minibatch=True)``, what its MpDeviceLoader uses) makes the global array of
    every host's rows, each host uploading only its own. torch_xla allows that only when the
    batch dimension is split over every device (init_python_bindings.cpp: "Minibatch sharding
    only supports sharding along the batch dimension"), which a batch replicated over a tensor
    axis is not: then ``tokens`` are the global batch (every host packs it anyway) and each
    host uploads only the rows its devices hold. See :func:`xtrain.parallelism.per_host_batch`.
    """
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.distributed.spmd as xs

    sharding = xs.ShardingSpec(mesh, batch_spec(tokens.dim()), minibatch=per_host)
    (on_device,) = xm.send_cpu_data_to_device([tokens], torch_xla.device(), input_sharding=sharding)
    return on_device


def counters() -> dict[str, int]:
    """Cumulative XLA compilations and device-to-host transfers of this process."""
    import torch_xla.debug.metrics as met

    def count(name):
        data = met.metric_data(name)
        return int(data[0]) if data else 0

    return {"xla_compiles": count("CompileTime"), "host_syncs": count("TransferFromDeviceTime")}


def sharding_specs(model) -> dict[str, str]:
    """name -> the HLO sharding string XLA holds for each parameter (for logs and tests)."""
    return {n: compat.sharding_spec(p) for n, p in model.named_parameters()}


def step_fence(model):
    """The fence between a compiled step's micro-batches (xtrain/engines/step.py) for ``model``
    with its layer loop installed (xtrain/xla/layers.py): the barrier below for unrolled blocks;
    for scanned ones the layer loop's, which places the same barrier at the scan."""
    return model.layer_loop.fence if model.config.scan else micro_batch_fence


def micro_batch_fence(tensors) -> None:
    """An optimization barrier over a micro-batch's inputs and the gradients accumulated before
    it (xtrain/engines/step.py): XLA may not move the micro-batch's work above it."""
    import torch_xla.core.xla_model as xm

    xm.optimization_barrier_(tensors)


def full_cpu_tensors(tensors: dict) -> dict:
    """SPMD tensors as whole CPU tensors, assembled on the host from this host's shards
    (compat.sharded_cpu_state_dict): ``.cpu()`` on a sharded tensor compiles a gather graph per
    tensor instead. Raises when this host does not hold every part of a tensor (a pod)."""
    import torch

    out = {}
    for name, value in compat.sharded_cpu_state_dict(tensors).items():
        if isinstance(value, torch.Tensor):  # replicated: already whole
            out[name] = value
            continue
        whole = torch.empty(value.global_shape, dtype=value.shards[0].data.dtype)
        covered = torch.zeros(value.global_shape, dtype=torch.bool)
        for shard in value.shards:  # indices: a list of slices, or Ellipsis when replicated
            if shard.indices is Ellipsis:
                where, data = ..., shard.data
            else:  # a shard of an uneven split is padded at its end
                where = tuple(shard.indices)
                data = shard.data[tuple(slice(0, s.stop - s.start) for s in shard.indices)]
            whole[where] = data
            covered[where] = True
        if not bool(covered.all()):
            raise RuntimeError(f"{name}: this host holds only part of it (multi-host)")
        out[name] = whole
    return out
