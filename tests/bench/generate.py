"""Generation speed: the KV cache (xtrain/model/generate.py) vs recomputing the whole sequence at
every token, on the d4 model (the one `make train` trains), greedy, the same tokens checked; and
on the XLA engine, generating on the XLA device vs on a CPU copy of the weights (a child process
on CPU PJRT, one device), which is how xtrain samples and evaluates during training."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

COMMAND = "make bench ARGS=generate   (python -m tests.bench generate)"
PROMPT, NEW, REPEATS = 16, 240, 3
XLA_NEW = 16  # 32 ran the child out of memory for LLVM's compiled code on this machine
ROOT = Path(__file__).resolve().parents[2]

# The XLA device's KV cache grows by one position per token, so every token's graph has new shapes
# (and ``.tolist()`` runs each one): torch_xla compiles a graph per token the first time a length
# is seen. Cold: a fresh process; warm: the same lengths again (graphs cached in memory).
XLA_CHILD = r"""
import json, sys, time, torch
import torch_xla, torch_xla.debug.metrics as met
from tests.bench.generate import _model, _prompt, XLA_NEW
from xtrain.model.generate import generate_ids
from xtrain.train.sampling import host_copy

torch.set_num_threads(2)
def compiles():
    data = met.metric_data("CompileTime")
    return data[0] if data else 0

model = _model().to(torch_xla.device())
prompt = _prompt(model)
out = {}
for name in ("cold", "warm"):
    c0, t0 = compiles(), time.perf_counter()
    ids = generate_ids(model, prompt, max_tokens=XLA_NEW, temperature=0)
    out[name] = {"seconds": time.perf_counter() - t0, "compiles": compiles() - c0, "ids": ids}
t0 = time.perf_counter()
cpu_model = host_copy(model)
copy_s = time.perf_counter() - t0
t0 = time.perf_counter()
ids = generate_ids(cpu_model, prompt, max_tokens=XLA_NEW, temperature=0)
out["cpu_copy"] = {"copy_s": copy_s, "seconds": time.perf_counter() - t0, "ids": ids}
print("RESULT " + json.dumps(out))
"""


def _model():
    from tests.conftest import compose_cfg
    from xtrain.model.config import GPTConfig
    from xtrain.model.gpt import GPT
    from xtrain.plan import resolve

    cfg = compose_cfg(["model=d4"])
    resolve(cfg, 1)
    torch.manual_seed(0)
    model = GPT(GPTConfig.from_model(cfg.model))
    with torch.no_grad():  # random weights everywhere (the zero-initialised projections too)
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    return model.eval()


def _best(model, prompt, n: int, kv_cache: bool) -> tuple[float, list]:
    from xtrain.model.generate import generate_ids

    best, out = float("inf"), None
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        out = generate_ids(model, prompt, n=n, max_tokens=NEW, temperature=0, kv_cache=kv_cache)
        best = min(best, time.perf_counter() - t0)
    return best, out


def _prompt(model) -> list[int]:
    return torch.randint(0, model.config.vocab_size, (PROMPT,),
                         generator=torch.Generator().manual_seed(0)).tolist()


def xla_vs_cpu_copy() -> str:
    env = {**os.environ, "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "1", "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-c", XLA_CHILD], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=1800)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    if r.returncode != 0 or not lines:  # a measurement that failed is reported, not a crash
        errors = [ln for ln in r.stderr.splitlines() if "rror" in ln]
        return (f"### On the XLA engine: the device vs a CPU copy\n\nThe XLA child process failed "
                f"(exit {r.returncode}): `{(errors or ['no error line'])[-1][-300:]}`\n")
    out = json.loads(lines[-1].removeprefix("RESULT "))
    cold, warm, cpu = out["cold"], out["warm"], out["cpu_copy"]
    assert cold["ids"] == warm["ids"] == cpu["ids"], "the XLA device and the CPU copy differ"
    cpu_s = cpu["copy_s"] + cpu["seconds"]
    rows = [("XLA device, first time (fresh process)", cold["seconds"], cold["compiles"]),
            ("XLA device, the same lengths again", warm["seconds"], warm["compiles"]),
            ("CPU copy (host_copy + CPU generation)", cpu_s, 0)]
    table = "\n".join(f"| {name} | {s:.2f} | {XLA_NEW / s:,.1f} | {c} ({c / XLA_NEW:.2f}) |"
                       for name, s, c in rows)
    if cpu_s < warm["seconds"]:
        verdict = ("the CPU copy, even against graphs already compiled, which is why xtrain samples "
                   "and evaluates on a CPU copy")
    elif cpu_s < cold["seconds"]:
        verdict = ("the CPU copy against a first generation (compiling), the XLA device once every "
                   "length's graph is compiled")
    else:
        verdict = "the XLA device: xtrain's CPU copy is the slower choice here"
    return (f"### On the XLA engine: the device vs a CPU copy\n\n"
            f"A child process on CPU PJRT (one device), the same d4 weights and prompt, greedy, "
            f"{XLA_NEW} new tokens, one sample; all three give the same tokens. The CPU copy "
            f"includes copying the weights off the device (xtrain/train/sampling.py's host_copy, "
            f"{cpu['copy_s']:.3f} s). On the device the KV cache grows by one position a token, so "
            f"the shapes change at every token: {cold['compiles']} graphs compiled for {XLA_NEW} "
            f"tokens ({cold['compiles'] / XLA_NEW:.2f} per token). Faster: **{verdict}**.\n\n"
            f"| where | seconds | tok/s | graphs compiled (per token) |\n"
            f"| --- | --- | --- | --- |\n{table}")


def run() -> str:
    torch.set_num_threads(2)
    model = _model()
    prompt = _prompt(model)
    rows = []
    for n in (1, 4):
        full_s, full = _best(model, prompt, n, kv_cache=False)
        kv_s, kv = _best(model, prompt, n, kv_cache=True)
        assert kv == full, "the KV cache changed the greedy tokens"
        rows.append((n, n * NEW / full_s, n * NEW / kv_s, full_s / kv_s))
    table = "\n".join(f"| {n} | {full:,.0f} | {kv:,.0f} | **{ratio:.1f}x** |" for n, full, kv, ratio in rows)
    c = model.config
    return (f"## Generation: KV cache vs full recomputation\n\n"
            f"`{COMMAND}`: model d4 ({c.n_layer} layers, width {c.n_embd}, vocab {c.vocab_size}, "
            f"context {c.sequence_len}), CPU, 2 threads, greedy, prompt {PROMPT} tokens + {NEW} new "
            f"(context nearly full at the end), best of {REPEATS}; both give the same tokens.\n\n"
            f"| samples per prompt | full recomputation tok/s | KV cache tok/s | speed-up |\n"
            f"| --- | --- | --- | --- |\n{table}\n\n{xla_vs_cpu_copy()}")
