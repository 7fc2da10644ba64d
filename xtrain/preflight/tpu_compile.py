"""Compile for a TPU topology on a machine without a TPU, with the real TPU compiler (libtpu).

Two kinds of request, each compiled in a child process (``python -m xtrain.tpu_compile KIND
REQUEST_JSON``) because libtpu can abort its whole process; the child reports JSON on its last
stdout line and a compiler failure comes back as ``{"ok": false, "error": ...}``, never raised:

- ``step``: a training step traced by :mod:`xtrain.xla.trace`, partitioned over the topology's
  chips (GSPMD) with the real run's argument shardings and buffer donation. Reports per-chip
  memory (arguments, outputs, aliases, temporaries), the FLOPs the compiler counts and the
  collectives in the partitioned program.
- ``kernel``: one Pallas attention kernel (flash, or splash for windowed layers), forward and
  backward, at the config's shapes: catches a kernel/version mismatch (jax 0.7.1 with libtpu
  0.0.21: "Failed to deserialize the Mosaic module") on its own.
"""

from __future__ import annotations

import json
import os
import re
import resource
import subprocess
import sys
import time

COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")
_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4,
                "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8}


def kernel_requests(hw, shape: dict, attention: str, device_batch: int) -> list[dict]:
    """One compile request per distinct kernel the model's layers use on this hardware."""
    from xtrain.hardware import topology_kwargs
    from xtrain.model.attention import tpu_kernel

    head_dim = shape["n_embd"] // shape["n_head"]
    dims = [device_batch, shape["n_head"], shape["sequence_len"], head_dim]
    kinds = {(kernel, w) for w in shape["windows"] if (kernel := tpu_kernel(attention, w))}
    return [{"topology": topology_kwargs(hw), "kernel": k, "window": w, "shape": dims}
            for k, w in sorted(kinds, key=str)]


def compile_kernel(request: dict, python: str = sys.executable, timeout: int = 600) -> dict:
    return _run_child("kernel", request, python, timeout)


def compile_step(request: dict, python: str = sys.executable, timeout: int = 3600) -> dict:
    """``request``: topology (get_topology_desc kwargs), devices, stablehlo (a file) and the
    trace's args/results annotations (see :func:`xtrain.xla.trace.trace_step`)."""
    return _run_child("step", request, python, timeout)


def _run_child(kind: str, request: dict, python: str, timeout: int) -> dict:
    # JAX_PLATFORMS=cpu would hide the TPU compiler; libtpu aborts with TPU_ACCELERATOR_TYPE set
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "TPU_ACCELERATOR_TYPE")}
    env["TPU_SKIP_MDS_QUERY"] = "1"  # compile-only: no TPU metadata server
    # compile-only clients use no TPU, so several may run at once (libtpu's lock file would
    # refuse the second)
    env["ALLOW_MULTIPLE_LIBTPU_LOAD"] = "1"
    # this module runs in any Python that has jax/libtpu (e.g. a second environment with other
    # versions), whether or not xtrain is installed there
    source_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [source_root, env.get("PYTHONPATH")]))
    try:
        r = subprocess.run([python, "-m", "xtrain.tpu_compile", kind, json.dumps(request)],
                           capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"ok": False, "error": f"the TPU compiler took longer than {timeout} s"}
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    if lines:
        return json.loads(lines[-1])
    if r.returncode == -9:  # SIGKILL: in practice the kernel's out-of-memory killer
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
        return {"ok": False, "error": "the compiler process was killed (SIGKILL), usually by the "
                                      f"out-of-memory killer: this machine's {ram:.0f} GiB of RAM "
                                      "(plus swap) are too little for this compile"}
    tail = r.stderr.strip().splitlines()[-1] if r.stderr.strip() else ""
    return {"ok": False, "error": f"the compiler process died (exit {r.returncode}): {tail}"}


def collective_summary(hlo_text: str) -> dict[str, dict[str, int]]:
    """kind -> {count, bytes} of the collectives in a compiled (partitioned) HLO module; bytes
    are the per-device result sizes.

    Each collective is counted once: async pairs at their ``-done``, and by channel id, because
    the TPU compiler clones one all-gather into many "async collective fusions" (pieces that
    overlap it with compute) that all carry the same channel: counting text occurrences made one
    gather of a [65536, 128] table look like thirty.
    """
    out: dict[str, dict[str, int]] = {}
    op = re.compile(r"=\s+(\(.*?\)|\S+)\s+(" + "|".join(COLLECTIVES) + r")(-done)?\((.*)")
    seen: set[str] = set()
    for match in op.finditer(hlo_text):
        shape, kind, rest = match.group(1), match.group(2), match.group(4)
        channel = re.search(r"channel_id=(\d+)", rest)
        if channel:
            if channel.group(1) in seen:
                continue
            seen.add(channel.group(1))
        nbytes = 0
        for dtype, dims in re.findall(r"(\w+)\[([\d,]*)\]", shape):
            n = _DTYPE_BYTES.get(dtype, 4)
            for d in filter(None, dims.split(",")):
                n *= int(d)
            nbytes += n
        entry = out.setdefault(kind, {"count": 0, "bytes": 0})
        entry["count"] += 1
        entry["bytes"] += nbytes
    return out


def hbm_from_error(error: str) -> tuple[int, int] | None:
    """(needed at least, usable) bytes per chip from the TPU compiler's out-of-HBM errors, or None.
    Two forms: the whole program ("Ran out of memory in memory space hbm. Used 33.98G of 31.25G
    hbm.", binary units) or one buffer ("Allocation (size=34359738368) would exceed memory
    (size=33822867456)")."""
    m = re.search(r"Used ([\d.]+)([KMGT]) of ([\d.]+)([KMGT]) hbm", error)
    if m:
        scale = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
        return (int(float(m.group(1)) * scale[m.group(2)]), int(float(m.group(3)) * scale[m.group(4)]))
    m = re.search(r"Allocation \(size=(\d+)\) would exceed memory \(size=(\d+)\)", error)
    return (int(m.group(1)), int(m.group(2))) if m else None


# --- the child side: runs with libtpu loaded -------------------------------------------------


def _topology_devices(kwargs: dict):
    from jax.experimental import topologies

    return topologies.get_topology_desc(**kwargs).devices


def _compile_kernel(req: dict) -> dict:
    import jax
    import jax.numpy as jnp

    devices = _topology_devices(req["topology"])
    sharding = jax.sharding.SingleDeviceSharding(devices[0])
    B, H, T, D = req["shape"]
    spec = jax.ShapeDtypeStruct((B, H, T, D), jnp.bfloat16, sharding=sharding)
    scale = D ** -0.5
    if req["kernel"] == "flash":
        from jax.experimental.pallas.ops.tpu.flash_attention import flash_attention

        def attn(q, k, v):
            return flash_attention(q, k, v, causal=True, sm_scale=scale)
    else:
        from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
        from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

        W, block = req["window"], min(512, T)
        mask = sm.CausalMask(shape=(T, T)) & sm.LocalMask(shape=(T, T), window_size=(W, W), offset=0)
        sizes = sk.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block,
                              block_q_dkv=block, block_kv_dkv=block, block_kv_dkv_compute=block,
                              use_fused_bwd_kernel=True)
        kernel = sk.make_splash_mha(mask=sm.MultiHeadMask(masks=(mask,) * H), head_shards=1,
                                    q_seq_shards=1, block_sizes=sizes)
        attn = jax.vmap(lambda q, k, v: kernel(q * scale, k, v))

    def loss(q, k, v):
        return attn(q, k, v).astype(jnp.float32).sum()

    t0 = time.time()
    compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(spec, spec, spec).compile()
    mem = compiled.memory_analysis()
    return {"ok": True, "seconds": round(time.time() - t0, 2), "jax": jax.__version__,
            "temp_bytes": mem.temp_size_in_bytes, "argument_bytes": mem.argument_size_in_bytes}


def _annotate(module, req: dict, n: int) -> None:
    """The real run's facts the exported text lacks: partition count, each argument's sharding
    and the output it is donated to, each result's sharding."""
    from jax._src.lib.mlir import ir

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
    from jax._src import compiler
    from jax._src.interpreters import mlir
    from jax._src.lib import xla_client as xc
    from jax._src.lib.mlir import ir

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
    return {"ok": True, "seconds": round(seconds, 2), "jax": jax.__version__,
            "argument_bytes": mem.argument_size_in_bytes, "output_bytes": mem.output_size_in_bytes,
            "alias_bytes": mem.alias_size_in_bytes, "temp_bytes": mem.temp_size_in_bytes,
            "flops": float(cost.get("flops", 0.0)),
            "collectives": collective_summary(executable.hlo_modules()[0].to_string()),
            # the compiler's host memory: large steps need a machine sized for it
            "host_peak_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


if __name__ == "__main__":
    kind, request = sys.argv[1], json.loads(sys.argv[2])
    try:
        result = {"kernel": _compile_kernel, "step": _compile_step}[kind](request)
    except Exception as e:  # report the compiler's own words to the parent
        result = {"ok": False, "error": f"{type(e).__name__}: {e}"}
    print(json.dumps(result), flush=True)
