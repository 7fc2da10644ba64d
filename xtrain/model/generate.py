"""Text generation from a GPT with a KV cache (torch only, on the model's device; the training
engines hand it a CPU copy).

:func:`generate` is the entry point for samples (training's, ``mode=sample``) and evaluations:
``n`` completions of each prompt, with temperature, top-k, a token budget, a stop hook and a
seed. Each prompt is run once over its tokens (prefill), its keys and values are copied to the
``n`` rows of the batch, then every step feeds one new token per row through the cached keys
(nanochat's engine does the same). ``kv_cache=False`` recomputes the whole sequence at every
token instead: the reference the cache is tested and benchmarked against.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from xtrain.errors import ConfigError


class LayerCache:
    """One layer's keys and values [B, Hkv, max_len, D]; positions ``0 .. length - 1`` are set."""

    def __init__(self, shape: tuple[int, ...], device, dtype):
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.length = 0

    def extend(self, k, v):
        """Append keys/values [B, Hkv, T, D]; returns every cached position's."""
        end = self.length + k.size(2)
        self.k[:, :, self.length:end] = k
        self.v[:, :, self.length:end] = v
        self.length = end
        return self.k[:, :, :end], self.v[:, :, :end]

    def repeat(self, n: int) -> None:
        self.k, self.v = self.k.repeat(n, 1, 1, 1), self.v.repeat(n, 1, 1, 1)


class KVCache:
    """Every layer's :class:`LayerCache` (``GPT.forward(idx, kv_cache=...)`` reads and extends it)."""

    def __init__(self, config, batch: int, max_len: int, device, dtype=torch.float32):
        shape = (batch, config.n_kv_head, max_len, config.head_dim)
        self.layers = [LayerCache(shape, device, dtype) for _ in range(config.n_layer)]

    @property
    def length(self) -> int:
        return self.layers[0].length

    def repeat(self, n: int) -> None:
        """Copy the cached rows ``n`` times (batch 1 -> n samples of one prompt)."""
        for layer in self.layers:
            layer.repeat(n)


def next_tokens(logits, temperature: float, top_k: int | None, generator) -> torch.Tensor:
    """[B, V] logits -> [B, 1] ids: greedy at temperature 0, else sampled from the ``top_k``
    likeliest (all when None)."""
    if temperature < torch.finfo(logits.dtype).tiny:  # (0 in the logits' dtype: greedy, the limit)
        return logits.argmax(dim=-1, keepdim=True)
    # the row's largest first: divided by a tiny temperature it stays 0, never inf (nor NaN)
    logits = (logits - logits.amax(dim=-1, keepdim=True)) / temperature
    if top_k is not None and top_k < logits.size(-1):
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator)


# Long: one loop holds the prefill, the per-row stop bookkeeping and both decoding paths (cached
# and recomputed), which the tests compare token for token.
@torch.no_grad()
def generate_ids(model, prompt: list[int], n: int = 1, max_tokens: int = 64, temperature: float = 1.0,
                 top_k: int | None = None, seed: int = 0, stop_ids=(),
                 stop: Callable[[list[int]], bool] | None = None, kv_cache: bool = True) -> list[list[int]]:
    """``n`` continuations (new token ids) of ``prompt``. A row ends at a token of ``stop_ids``
    (not kept), when ``stop(ids so far)`` is true (kept), or after ``max_tokens``. Prompt plus
    ``max_tokens`` must fit the model's context (``sequence_len``)."""
    limit = model.config.sequence_len
    if not prompt or len(prompt) + max_tokens > limit:
        raise ValueError(f"prompt of {len(prompt)} tokens + max_tokens {max_tokens} must be 1..{limit} "
                         "tokens (the model's sequence_len)")
    model.eval()
    device = next(model.parameters()).device
    # greedy needs none (and an XLA device has no torch.Generator: tests/bench/generate.py)
    generator = torch.Generator(device=device).manual_seed(seed) if temperature > 0 else None
    ids = torch.tensor([prompt], device=device)
    cache = None
    if kv_cache:
        cache = KVCache(model.config, 1, len(prompt) + max_tokens, device,
                        next(model.parameters()).dtype)
        logits = model(ids, kv_cache=cache)[:, -1]
        cache.repeat(n)
    else:
        logits = model(ids)[:, -1]
    logits, ids = logits.expand(n, -1), ids.expand(n, -1)
    out: list[list[int]] = [[] for _ in range(n)]
    done = [False] * n
    stop_ids = set(stop_ids)
    for step in range(max_tokens):
        nxt = next_tokens(logits, temperature, top_k, generator)
        for row, token in enumerate(nxt[:, 0].tolist()):
            if done[row]:
                continue
            if token in stop_ids:
                done[row] = True
                continue
            out[row].append(token)
            done[row] = stop is not None and stop(out[row])
        if all(done) or step == max_tokens - 1:
            break
        if kv_cache:
            logits = model(nxt, kv_cache=cache)[:, -1]
        else:
            ids = torch.cat([ids, nxt], dim=1)
            logits = model(ids)[:, -1]
    return out


def prompt_ids(tokenizer, prompt: str) -> list[int]:
    """A prompt as the model sees it: BOS (a document's start), then its tokens."""
    return [tokenizer.bos_id] + tokenizer.encode(prompt)


def check_prompts_fit(tokenizer, prompts: list[str], max_tokens: int | None, sequence_len: int,
                      field: str) -> None:
    """Refuse, before generating, prompts that leave no room for ``max_tokens`` (named ``field``;
    None: at least one token) in the model's context."""
    for prompt in prompts:
        n = len(prompt_ids(tokenizer, prompt))
        if n >= sequence_len:  # no setting of the generation helps
            raise ConfigError(f"prompt {prompt!r} ({n} tokens) alone fills the model's "
                              f"sequence_len {sequence_len}: it needs a model trained with a "
                              "longer model.sequence_len, or a shorter prompt")
        if n + (max_tokens or 1) > sequence_len:
            room = f"{field}={max_tokens}" if max_tokens else "a generated token"
            raise ConfigError(f"prompt {prompt!r} ({n} tokens) + {room} exceed the "
                              f"model's sequence_len {sequence_len}: lower {field} or shorten "
                              "the prompt")


def generate(model, tokenizer, prompts: list[str], n: int = 1, *, max_tokens: int = 64,
             temperature: float = 0.8, top_k: int | None = 50, seed: int = 0,
             stop: Callable[[str], bool] | None = None, stats: dict | None = None,
             kv_cache: bool = True) -> list[list[str]]:
    """``n`` completions (the text after the prompt) of each prompt. The tokenizer's BOS starts
    every prompt and ends a completion (documents are separated by it); ``stop(completion so
    far)`` true ends one too. Prompt ``i`` is sampled with seed ``seed + i``, so a prompt's
    completions do not depend on the others. ``stats``, when given, receives ``tokens``
    (generated) and ``seconds``."""
    t0, tokens, texts = time.perf_counter(), 0, []
    text_stop = (lambda ids: stop(tokenizer.decode(ids))) if stop is not None else None
    for i, prompt in enumerate(prompts):
        rows = generate_ids(model, prompt_ids(tokenizer, prompt), n, max_tokens,
                            temperature, top_k, seed + i, stop_ids=(tokenizer.bos_id,),
                            stop=text_stop, kv_cache=kv_cache)
        tokens += sum(len(r) for r in rows)
        texts.append([tokenizer.decode(r) for r in rows])
    if stats is not None:
        stats.update(tokens=tokens, seconds=time.perf_counter() - t0)
    return texts
