"""Generation speed: the KV cache (xtrain/model/generate.py) vs recomputing the whole sequence at
every token, on the d4 model (the one `make train` trains), greedy, the same tokens checked."""

from __future__ import annotations

import time

import torch

COMMAND = "make bench ARGS=generate   (python -m tests.bench generate)"
PROMPT, NEW, REPEATS = 16, 240, 3


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


def run() -> str:
    torch.set_num_threads(2)
    model = _model()
    prompt = torch.randint(0, model.config.vocab_size, (PROMPT,),
                           generator=torch.Generator().manual_seed(0)).tolist()
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
            f"| --- | --- | --- | --- |\n{table}\n")
