"""Compile for a TPU topology on a machine without a TPU, with the real TPU compiler (libtpu).

The child side (``python -m xtrain.preflight.tpu_compile KIND REQUEST_JSON``; the parent,
xtrain/preflight/__init__.py, starts it because libtpu can abort its whole process). It reports
JSON on its last stdout line and a compiler failure comes back as ``{"ok": false, "error":
...}``, never raised. Two kinds of request:

- ``step``: a training step traced by :mod:`xtrain.preflight.trace`, partitioned over the topology's
  chips (GSPMD) with the real run's argument shardings and buffer donation. Reports per-chip
  memory (arguments, outputs, aliases, temporaries), the FLOPs the compiler counts and the
  collectives in the partitioned program.
- ``kernel``: one Pallas attention kernel (flash, or splash for windowed layers), forward and
  backward, at the config's shapes: catches a kernel/version mismatch (jax 0.7.1 with libtpu
  0.0.21: "Failed to deserialize the Mosaic module") on its own.
- ``lower``: only lower a kernel request to StableHLO text (``out``, a file), with no libtpu:
  how a kernel payload of another jax version is recorded for the tests.
"""

from __future__ import annotations

import json
import resource
import sys
import time

# Only dependency-free xtrain modules: this child runs in any Python that has jax and libtpu
# (e.g. a second environment with other versions), with xtrain's source on PYTHONPATH.
from xtrain.compat import jax_compiler_internals
from xtrain.model.config import SPLASH_BLOCK
from xtrain.preflight.report import collective_summary, count_hlo_instructions


def _host_peak_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _topology_devices(kwargs: dict):
    from jax.experimental import topologies

    return topologies.get_topology_desc(**kwargs).devices


def lower_kernel(req: dict) -> str:
    """One Pallas attention kernel (flash, or splash for a windowed layer), forward and backward
    at the request's shape, lowered for the TPU by this process's jax: StableHLO text whose
    custom calls carry the Mosaic kernels in the serialization format of this jax version.
    Needs no TPU and no libtpu."""
    import jax
    import jax.numpy as jnp

    B, H, T, D = req["shape"]
    spec = jax.ShapeDtypeStruct((B, H, T, D), jnp.bfloat16)
    scale = D ** -0.5
    if req["kernel"] == "flash":
        from jax.experimental.pallas.ops.tpu.flash_attention import flash_attention

        def attn(q, k, v):
            return flash_attention(q, k, v, causal=True, sm_scale=scale)
    else:
        from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
        from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

        W, block = req["window"], min(SPLASH_BLOCK, T)
        mask = sm.CausalMask(shape=(T, T)) & sm.LocalMask(shape=(T, T), window_size=(W, W), offset=0)
        sizes = sk.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block,
                              block_q_dkv=block, block_kv_dkv=block, block_kv_dkv_compute=block,
                              use_fused_bwd_kernel=True)
        kernel = sk.make_splash_mha(mask=sm.MultiHeadMask(masks=(mask,) * H), head_shards=1,
                                    q_seq_shards=1, block_sizes=sizes)
        attn = jax.vmap(lambda q, k, v: kernel(q * scale, k, v))

    def loss(q, k, v):
        return attn(q, k, v).astype(jnp.float32).sum()

    traced = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(spec, spec, spec)
    return traced.lower(lowering_platforms=("tpu",)).as_text()


def _compile_kernel(req: dict) -> dict:
    """Compile a kernel for one chip of the topology: lowered here, or, with ``lowered`` (a
    file), as another jax version lowered it (see :func:`lower_kernel`): a kernel payload this
    libtpu cannot read fails with the compiler's reason."""
    import jax
    import numpy as np

    ir, mlir, compiler, xc = jax_compiler_internals()
    if req.get("lowered"):
        with open(req["lowered"]) as f:
            text = f.read()
    else:
        text = lower_kernel(req)
    devices = _topology_devices(req["topology"])[:1]
    client = devices[0].client
    with mlir.make_ir_context():
        module = ir.Module.parse(text)
        options = compiler.get_compile_options(
            num_replicas=1, num_partitions=1, device_assignment=np.array(devices).reshape(1, 1),
            backend=client)
        t0 = time.time()
        executable = compiler.backend_compile(client, module, xc.DeviceList(tuple(devices)), options)
    mem = executable.get_compiled_memory_stats()
    return {"ok": True, "seconds": round(time.time() - t0, 2), "jax": jax.__version__,
            "temp_bytes": mem.temp_size_in_bytes, "argument_bytes": mem.argument_size_in_bytes}


def _lower_kernel_to_file(req: dict) -> dict:
    import jax
    import jaxlib

    with open(req["out"], "w") as f:
        f.write(lower_kernel(req))
    return {"ok": True, "jax": jax.__version__, "jaxlib": jaxlib.__version__}


def _annotate(module, req: dict, n: int) -> None:
    """The real run's facts the exported text lacks: partition count, each argument's sharding
    and the output it is donated to, each result's sharding."""
    ir, _, _, _ = jax_compiler_internals()
    i32 = ir.IntegerType.get_signless(32)
    attrs = module.operation.attributes
    attrs["mhlo.num_partitions"] = ir.IntegerAttr.get(i32, n)
    attrs["mhlo.num_replicas"] = ir.IntegerAttr.get(i32, 1)
    if "mhlo.input_output_alias" in attrs:
        del attrs["mhlo.input_output_alias"]  # torch_xla writes an empty one; aliases go per arg
    main = next(op for op in module.body.operations if op.name.value == "main")

    def dict_attr(old, extra: dict):
        entries = {a.name: a.attr for a in old} if old is not None else {}
        entries.update(extra)
        return ir.DictAttr.get(entries)

    arg_attrs = list(main.arg_attrs) if "arg_attrs" in main.attributes else [None] * len(req["args"])
    if len(arg_attrs) != len(req["args"]):
        raise ValueError(f"trace annotations cover {len(req['args'])} arguments, module has {len(arg_attrs)}")
    new_args = []
    for old, arg in zip(arg_attrs, req["args"]):
        extra = {"mhlo.sharding": ir.StringAttr.get(arg["sharding"])}
        if arg["alias"] is not None:
            extra["tf.aliasing_output"] = ir.IntegerAttr.get(i32, arg["alias"])
        new_args.append(dict_attr(old, extra))
    main.arg_attrs = ir.ArrayAttr.get(new_args)
    res_attrs = list(main.res_attrs) if "res_attrs" in main.attributes else [None] * len(req["results"])
    main.res_attrs = ir.ArrayAttr.get([dict_attr(old, {"mhlo.sharding": ir.StringAttr.get(s)})
                                       for old, s in zip(res_attrs, req["results"])])


def _compile_step(req: dict) -> dict:
    import jax
    import numpy as np

    ir, mlir, compiler, xc = jax_compiler_internals()

    # torch_xla exports GSPMD annotations (mhlo.sharding), not Shardy's
    jax.config.update("jax_use_shardy_partitioner", False)
    n = req["devices"]
    devices = _topology_devices(req["topology"])
    if len(devices) != n:
        raise ValueError(f"topology {req['topology']['topology_name']} has {len(devices)} devices, "
                         f"the step was traced for {n}")
    client = devices[0].client
    with open(req["stablehlo"]) as f:
        text = f.read()
    with mlir.make_ir_context():
        module = ir.Module.parse(text)
        _annotate(module, req, n)
        options = compiler.get_compile_options(
            num_replicas=1, num_partitions=n, device_assignment=np.array(devices).reshape(1, n),
            use_spmd_partitioning=True, backend=client)
        t0 = time.time()
        executable = compiler.backend_compile(client, module, xc.DeviceList(tuple(devices)), options)
        seconds = time.time() - t0
    mem = executable.get_compiled_memory_stats()
    cost = executable.cost_analysis() or {}
    if isinstance(cost, list):
        cost = cost[0] if cost else {}
    hlo = "\n".join(m.to_string() for m in executable.hlo_modules())
    return {"ok": True, "seconds": round(seconds, 2), "jax": jax.__version__,
            "hlo_instructions": count_hlo_instructions(hlo),
            "argument_bytes": mem.argument_size_in_bytes, "output_bytes": mem.output_size_in_bytes,
            "alias_bytes": mem.alias_size_in_bytes, "temp_bytes": mem.temp_size_in_bytes,
            "flops": float(cost.get("flops", 0.0)),
            "collectives": collective_summary(hlo),
            # the compiler's host memory: large steps need a machine sized for it
            "host_peak_bytes": _host_peak_bytes()}


def answer(kind: str, request: dict) -> dict:
    """The result of one request, a failure included. Only the compiler's own answers are
    "answered": running out of host memory says nothing about the config, so it is not cached
    as the config's verdict (the same command on a larger machine compiles)."""
    try:
        return {"kernel": _compile_kernel, "step": _compile_step,
                "lower": _lower_kernel_to_file}[kind](request)
    except MemoryError:  # Python's allocation failed: this machine's limit, not the config's
        return {"ok": False, "answered": False, "host_peak_bytes": _host_peak_bytes(),
                "error": "the compiler process ran out of host memory (MemoryError): this "
                         "machine's RAM was too little for this compile"}
    except Exception as e:  # report the compiler's own words to the parent
        return {"ok": False, "error": f"{type(e).__name__}: {e}", "host_peak_bytes": _host_peak_bytes()}


if __name__ == "__main__":
    print(json.dumps(answer(sys.argv[1], json.loads(sys.argv[2]))), flush=True)
