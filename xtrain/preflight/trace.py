"""Trace one training step of a config as StableHLO on XLA:CPU, for the TPU compiler.

The traced function is the training step itself: ``GPTModule.step_closure`` (every micro-batch's
forward and backward, clipping) inside ``MuonAdamW.step``, with the parallelism's shardings, over
as many virtual CPU devices as the target has chips. Nothing is computed or stored: parameters,
optimizer state and the batch are torch_xla placeholders (tensors without a buffer), so even a
billion-parameter model traces in little host memory.

torch_xla cannot attach a sharding to a placeholder, so the trace returns, for every argument of
the exported function, the HLO sharding its tensor has in a real run and the output it is updated
into (the buffer donation torch_xla does at every step); :mod:`xtrain.tpu_compile` applies both
before compiling.

Pallas kernels (flash, and splash for windowed layers) are lowered for the TPU by JAX's
cross-platform lowering, so the exported step holds the same ``tpu_custom_call`` the TPU runs.

Run as a child: ``python -m xtrain.xla.trace CONFIG.yaml OUT_DIR``, with ``PJRT_DEVICE=CPU
CPU_NUM_DEVICES=<chips>`` (see :func:`xtrain.preflight.trace_environment`).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path


def lower_kernels_for_tpu(n_devices: int) -> None:
    """Make torch_xla's Pallas kernels lower for the TPU rather than for the process's JAX
    backend (CPU here, where Mosaic has no lowering).

    - flash: torch_xla's ``trace_pallas`` calls ``jax.jit(kernel).lower(...)`` on the default
      backend and has no platform argument; it is replaced by the same steps with
      ``lowering_platforms=("tpu",)``.
    - splash: torch_xla runs it through ``call_jax`` (a ``shard_map`` over a mesh of JAX's own
      devices, lowered to HLO by ``JaxCallable.specialize``, again on the default backend). JAX
      gets one CPU device per virtual torch_xla device, so that mesh exists, and
      ``specialize`` lowers for the TPU.
    """
    import jax
    import torch
    import torch_xla.core.xla_builder as xb
    import torch_xla.experimental.custom_kernel as custom_kernel

    jax.config.update("jax_num_cpu_devices", n_devices)  # before JAX's CPU backend starts

    def trace_pallas(kernel, *args, static_argnums=None, static_argnames=None, use_cache=False,
                     **kwargs):
        import jax._src.pallas.mosaic.pallas_call_registration  # noqa: F401  (registers Mosaic)

        specs = [custom_kernel.to_jax_shape_dtype_struct(a) if torch.is_tensor(a) else a
                 for a in args]
        traced = jax.jit(kernel, static_argnums=static_argnums,
                         static_argnames=static_argnames).trace(*specs, **kwargs)
        ir = traced.lower(lowering_platforms=("tpu",)).compiler_ir()
        return custom_kernel._extract_backend_config(ir), [a for a in args if torch.is_tensor(a)]

    def specialize(self, sample_flat_args):
        from torchax.ops.mappings import t2j_dtype

        specs = tuple(None if a is None else jax.ShapeDtypeStruct(a.shape, t2j_dtype(a.dtype))
                      for a in sample_flat_args)
        traced = jax.jit(self._flat_input_func.flat_call, keep_unused=True).trace(specs)
        hlo = traced.lower(lowering_platforms=("tpu",)).compiler_ir("hlo")
        computation = xb.computation_from_module_proto(
            "jax_callable", hlo.as_serialized_hlo_module_proto())
        return xb.xla_computation_as_func(computation, "jax_func")

    custom_kernel.trace_pallas = trace_pallas
    xb.JaxCallable.specialize = specialize


def trace_step(cfg, plan) -> dict:
    """StableHLO of one optimizer step plus, per argument, its sharding and aliased output."""
    import torch
    import torch_xla
    import torch_xla.core.xla_builder as xb
    import torch_xla.core.xla_model as xm
    import torch_xla.distributed.spmd as xs
    import torch_xla.runtime as xr

    from xtrain.model.gpt import rotary_tables
    from xtrain.parallelism import check_rules
    from xtrain.plan import gpt_config
    from xtrain.train.module import GPTModule
    from xtrain.xla.spmd import batch_spec, build_mesh, optimizer_state_specs, set_attention_partition

    gpt = gpt_config(cfg.model, plan.attention)
    lower_kernels_for_tpu(cfg.hardware.chips)
    xr.use_spmd()
    mesh = build_mesh(plan.mesh)
    device = torch_xla.device()

    def placeholder(like):
        return xb.create_placeholder_tensor(tuple(like.shape), like.dtype)

    with torch.device("meta"):  # shapes only: no host memory for the weights
        module = GPTModule(gpt, cfg.optim, plan.max_steps, precision=cfg.hardware.precision)
    model = module.model
    for sub in model.modules():
        for name, p in list(sub.named_parameters(recurse=False)):
            sub._parameters[name] = torch.nn.Parameter(placeholder(p))
    cos, sin = rotary_tables(model.config.sequence_len, model.config.head_dim)
    model.cos, model.sin = cos.to(device), sin.to(device)  # small real buffers, as in training
    set_attention_partition(model)
    sizes = dict(zip(mesh.axis_names, mesh.mesh_shape))
    param_specs = check_rules(cfg.parallelism.rules, sizes,
                              {n: tuple(p.shape) for n, p in model.named_parameters()})
    optimizer = module.configure_optimizers()
    optimizer.init_state(make=placeholder)
    rows = cfg.trainer.device_batch_size * plan.batch.data_parallel
    tokens = xb.create_placeholder_tensor(
        (plan.batch.grad_accum_steps, rows, cfg.model.sequence_len + 1), torch.int32)

    tensor_id = torch_xla._XLAC._xla_get_tensor_id
    state = [(p, param_specs[n]) for n, p in model.named_parameters()]
    state += list(optimizer_state_specs(optimizer, model, param_specs))
    spec_of = {tensor_id(t): (spec, t.dim()) for t, spec in state}
    spec_of[tensor_id(tokens)] = (batch_spec(3), 3)
    # ids before the step: an in-place update gives a tensor a new id, its input keeps the old one
    output_of = {tensor_id(t): i for i, (t, _) in enumerate(state)}

    t0 = time.time()
    loss = optimizer.step(closure=module.step_closure(tokens, backward=torch.Tensor.backward))
    optimizer.zero_grad(set_to_none=True)
    outputs = [t for t, _ in state] + [optimizer.last_lr_multiplier(), loss]
    # graph inputs in the exported function's argument order (torch_xla's own exporter relies on
    # the same correspondence, torch_xla/stablehlo.py)
    input_ids, _ = torch_xla._XLAC._get_tensors_xla_device_data_node(outputs)
    stablehlo = xm.get_stablehlo(outputs)
    shardings: dict = {}

    def sharding(spec, ndim):
        if spec is None or all(axis is None for axis in spec):
            return "{replicated}"
        if (spec, ndim) not in shardings:  # the HLO string depends on the spec, not the shape
            probe = torch.zeros((mesh.size(),) * ndim, device=device)
            xs.mark_sharding(probe, mesh, spec)
            shardings[spec, ndim] = torch_xla._XLAC._get_xla_sharding_spec(probe)
        return shardings[spec, ndim]

    args = [{"sharding": sharding(*spec_of.get(i, (None, 0))), "alias": output_of.get(i)}
            for i in input_ids]
    results = [sharding(spec, t.dim()) for t, spec in state] + ["{replicated}"] * 2
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
