"""Compile for a TPU topology on a machine without a TPU, with the real TPU compiler (libtpu).

First piece of the TPU preflight: the Pallas attention kernels a config will run (flash, or
splash for windowed layers) are compiled, forward and backward, for the hardware profile's
topology, so a kernel/version mismatch (jax 0.7.1 with libtpu 0.0.21: "Failed to deserialize the
Mosaic module") is caught before a TPU is rented. libtpu can abort its whole process, so the
compile runs in a child process and reports JSON on its last stdout line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

_CHILD = r"""
import json, os, sys, time
os.environ["TPU_SKIP_MDS_QUERY"] = "1"  # compile-only: no TPU metadata server
req = json.loads(sys.argv[1])
try:
    import jax, jax.numpy as jnp
    from jax.experimental import topologies
    topo = topologies.get_topology_desc(**req["topology"])
    sharding = jax.sharding.SingleDeviceSharding(topo.devices[0])
    B, H, T, D = req["shape"]
    spec = jax.ShapeDtypeStruct((B, H, T, D), jnp.bfloat16, sharding=sharding)
    scale = D ** -0.5
    if req["kernel"] == "flash":
        from jax.experimental.pallas.ops.tpu.flash_attention import flash_attention
        attn = lambda q, k, v: flash_attention(q, k, v, causal=True, sm_scale=scale)
    else:
        from jax.experimental.pallas.ops.tpu.splash_attention import (
            splash_attention_kernel as sk, splash_attention_mask as sm)
        W, block = req["window"], min(512, T)
        mask = sm.CausalMask(shape=(T, T)) & sm.LocalMask(shape=(T, T), window_size=(W, W), offset=0)
        sizes = sk.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block,
                              block_q_dkv=block, block_kv_dkv=block, block_kv_dkv_compute=block,
                              use_fused_bwd_kernel=True)
        kernel = sk.make_splash_mha(mask=sm.MultiHeadMask(masks=(mask,) * H), head_shards=1,
                                    q_seq_shards=1, block_sizes=sizes)
        attn = jax.vmap(lambda q, k, v: kernel(q * scale, k, v))
    loss = lambda q, k, v: attn(q, k, v).astype(jnp.float32).sum()
    t0 = time.time()
    compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(spec, spec, spec).compile()
    mem = compiled.memory_analysis()
    out = {"ok": True, "seconds": round(time.time() - t0, 2), "jax": jax.__version__,
           "temp_bytes": mem.temp_size_in_bytes, "argument_bytes": mem.argument_size_in_bytes}
except Exception as e:
    out = {"ok": False, "error": f"{type(e).__name__}: {e}"}
print(json.dumps(out))
"""


def kernel_requests(hw, shape: dict, attention: str, device_batch: int) -> list[dict]:
    """One compile request per distinct kernel the model's layers use on this hardware."""
    from xtrain.hardware import topology_kwargs

    if attention not in ("flash", "splash"):
        return []
    head_dim = shape["n_embd"] // shape["n_head"]
    dims = [device_batch, shape["n_head"], shape["sequence_len"], head_dim]
    kinds = {("flash" if attention == "flash" and w is None else "splash", w) for w in shape["windows"]}
    return [{"topology": topology_kwargs(hw), "kernel": k, "window": w, "shape": dims}
            for k, w in sorted(kinds, key=str)]


def compile_kernel(request: dict, python: str = sys.executable, timeout: int = 600) -> dict:
    """Compile one kernel request in a child process; never raises for a compiler failure."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("JAX_PLATFORMS", "TPU_ACCELERATOR_TYPE")}  # libtpu aborts with the latter
    r = subprocess.run([python, "-c", _CHILD, json.dumps(request)], capture_output=True, text=True,
                       timeout=timeout, env=env)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    if lines:
        return json.loads(lines[-1])
    return {"ok": False, "error": f"the compiler process died (exit {r.returncode}): "
                                  f"{r.stderr.strip().splitlines()[-1] if r.stderr.strip() else ''}"}
