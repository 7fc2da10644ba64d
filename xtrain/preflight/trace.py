"""Trace one training step of a config as StableHLO on XLA:CPU, for the TPU compiler.

The traced function is the training step itself: :func:`xtrain.engines.step.step_closure`
(every micro-batch's forward and backward, clipping) inside ``MuonAdamW.step``, with the parallelism's shardings, over
as many virtual CPU devices as the target has chips. Nothing is computed or stored: parameters,
optimizer state and the batch are torch_xla placeholders (tensors without a buffer), so even a
billion-parameter model traces in little host memory.

torch_xla cannot attach a sharding to a placeholder, so the trace returns, for every argument of
the exported function, the HLO sharding its tensor has in a real run and the output it is updated
into (the buffer donation torch_xla does at every step); :mod:`xtrain.preflight.tpu_compile` applies both
before compiling.

Pallas kernels (flash, and splash for windowed layers) are lowered for the TPU by JAX's
cross-platform lowering (:func:`xtrain.compat.lower_pallas_for_tpu`), so the exported step holds
the same ``tpu_custom_call`` the TPU runs.

Run as a child: ``python -m xtrain.preflight.trace CONFIG.yaml OUT_DIR``, with ``PJRT_DEVICE=CPU
CPU_NUM_DEVICES=<chips>`` (see :func:`xtrain.preflight.targets.trace_environment`).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
import torch_xla
import torch_xla.core.xla_builder as xb
import torch_xla.core.xla_model as xm
import torch_xla.distributed.spmd as xs
import torch_xla.runtime as xr

from xtrain import compat
from xtrain.engines.step import step_closure
from xtrain.model.gpt import GPT, rotary_tables
from xtrain.optim import build_optimizer
from xtrain.parallelism import check_rules
from xtrain.xla.layers import install_layer_loop
from xtrain.xla.spmd import (batch_spec, build_mesh, optimizer_state_specs, step_fence,
                              set_attention_partition)


def placeholder(like):
    return xb.create_placeholder_tensor(tuple(like.shape), like.dtype)


def placeholder_model(gpt, device):
    """The model with every parameter a placeholder; the rotary tables are small real buffers,
    as in training."""
    with torch.device("meta"):  # shapes only: no host memory for the weights
        model = GPT(gpt)
    for sub in model.modules():
        for name, p in list(sub.named_parameters(recurse=False)):
            sub._parameters[name] = torch.nn.Parameter(placeholder(p))
    cos, sin = rotary_tables(gpt.sequence_len, gpt.head_dim)
    model.cos, model.sin = cos.to(device), sin.to(device)
    return model


def hlo_sharding(mesh, spec, ndim: int, cache: dict) -> str:
    """The HLO sharding string of ``spec`` on ``mesh`` (it depends on the spec, not the shape)."""
    if spec is None or all(axis is None for axis in spec):
        return "{replicated}"
    if (spec, ndim) not in cache:
        probe = torch.zeros((mesh.size(),) * ndim, device=torch_xla.device())
        xs.mark_sharding(probe, mesh, spec)
        cache[spec, ndim] = compat.sharding_spec(probe)
    return cache[spec, ndim]


def trace_step(cfg, plan) -> dict:
    """StableHLO of one optimizer step plus, per argument, its sharding and aliased output."""
    compat.lower_pallas_for_tpu(cfg.hardware.chips)
    xr.use_spmd()
    mesh = build_mesh(plan.mesh)
    precision = cfg.hardware.precision
    model = placeholder_model(plan.gpt, torch_xla.device())
    set_attention_partition(model)
    sizes = dict(zip(mesh.axis_names, mesh.mesh_shape))
    param_specs = check_rules(cfg.parallelism.rules, sizes,
                              {n: tuple(p.shape) for n, p in model.named_parameters()})
    install_layer_loop(model, param_specs, mesh)
    optimizer = build_optimizer(model, cfg.optim, plan.max_steps, precision)
    optimizer.init_state(make=placeholder)
    rows = cfg.trainer.device_batch_size * plan.batch.data_parallel
    tokens = xb.create_placeholder_tensor(
        (rows, plan.batch.grad_accum_steps, plan.gpt.sequence_len + 1), torch.int32)

    state = [(p, param_specs[n]) for n, p in model.named_parameters()]
    state += list(optimizer_state_specs(optimizer, model, param_specs))
    # matched by the handle of the data each argument reads (ids change with in-place updates)
    handles = compat.data_handles([t for t, _ in state] + [tokens])
    spec_of = {h: (spec, t.dim()) for h, (t, spec) in zip(handles, state)}
    spec_of[handles[-1]] = (batch_spec(3), 3)
    output_of = {h: i for i, h in enumerate(handles[:-1])}

    t0 = time.time()
    loss = optimizer.step(closure=step_closure(model, tokens, torch.Tensor.backward,
                                               cfg.optim.grad_clip, precision,
                                               fence=step_fence(model)))
    optimizer.zero_grad(set_to_none=True)
    outputs = [t for t, _ in state] + [optimizer.last_lr_multiplier(), loss]
    input_ids = compat.graph_input_handles(outputs)  # in the exported function's argument order
    stablehlo = xm.get_stablehlo(outputs)
    cache: dict = {}
    args = [{"sharding": hlo_sharding(mesh, *spec_of.get(i, (None, 0)), cache),
             "alias": output_of.get(i)} for i in input_ids]
    results = [hlo_sharding(mesh, spec, t.dim(), cache) for t, spec in state] + ["{replicated}"] * 2
    return {"stablehlo": stablehlo, "args": args, "results": results,
            "devices": xr.global_runtime_device_count(), "trace_seconds": round(time.time() - t0, 2)}


def main(config_path: str, out_dir: str) -> None:
    from omegaconf import OmegaConf

    from xtrain.plan import resolve

    cfg = OmegaConf.load(config_path)
    plan = resolve(cfg, cfg.hardware.chips)
    traced = trace_step(cfg, plan)
    out = Path(out_dir)
    (out / "step.mlir").write_text(traced.pop("stablehlo"))
    (out / "step.json").write_text(json.dumps(traced))


if __name__ == "__main__":
    main(*sys.argv[1:3])
