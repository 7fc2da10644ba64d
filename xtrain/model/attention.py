"""Causal self-attention backends behind one function, :func:`attend`.

All backends take ``q: [B, H, T, D]`` and ``k, v: [B, Hkv, T, D]`` (GQA when ``Hkv < H``) and a
``window``: ``None`` for full causal attention, or ``W`` so that query ``i`` sees keys
``i - W .. i`` (``W + 1`` keys; the convention of flash-attn's ``window_size=(W, 0)`` and of
splash attention's ``LocalMask((T, T), (W, 0), 0)``). The softmax scale is always
``1 / sqrt(D)``.

- ``sdpa``: torch's fused kernel; a boolean mask when windowed. Eager CPU/GPU.
- ``chunked``: blockwise online-softmax attention with a hand-written blockwise backward, in plain
  torch ops, so it runs under XLA on any device; memory O(T * block) instead of O(T^2).
  Fully-masked blocks (above the diagonal, outside the window) are skipped at trace time.
- ``flash``: torch_xla's Pallas flash-attention kernel (TPU only). It has no sliding windows:
  windowed layers go to ``splash``.
- ``splash``: torch_xla's Pallas splash-attention kernel with a local mask (TPU only).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from xtrain.config import BATCH_AXES, Attention
from xtrain.model.config import SPLASH_BLOCK, SPLASH_HEAD_DIM, tpu_kernel


def attend(q, k, v, window: int | None, backend: str, block: int | None = None, partition_spec=None):
    """Causal attention of ``backend``; ``block`` is the chunked backend's block size."""
    if backend == Attention.sdpa:
        return sdpa_attention(q, k, v, window)
    if backend == Attention.chunked:
        return chunked_attention(q, k, v, window, block)
    kernel = tpu_kernel(backend, window)
    if kernel == Attention.flash:
        return tpu_flash_attention(q, k, v, partition_spec)
    if kernel == Attention.splash:
        return tpu_splash_attention(q, k, v, window, partition_spec)
    raise ValueError(f"model.attention={backend!r}: expected one of "
                     f"{[a.value for a in Attention if a != Attention.auto]}")


def allowed_mask(n_q: int, n_k: int, window: int | None, q_start: int = 0, k_start: int = 0,
                 device=None) -> torch.Tensor:
    """Boolean [n_q, n_k] mask: True where query (q_start + i) may attend key (k_start + j)."""
    i = torch.arange(q_start, q_start + n_q, device=device)[:, None]
    j = torch.arange(k_start, k_start + n_k, device=device)[None, :]
    ok = j <= i
    if window is not None:
        ok = ok & (i - j <= window)
    return ok


def reference_attention(q, k, v, window: int | None):
    """Materialised attention in the inputs' dtype: the ground truth for tests (use float64)."""
    k, v = _repeat_kv(k, q.size(1)), _repeat_kv(v, q.size(1))
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(q.size(-1))
    mask = allowed_mask(q.size(-2), k.size(-2), window, device=q.device)
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def sdpa_attention(q, k, v, window: int | None):
    gqa = k.size(1) != q.size(1)
    if window is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    mask = allowed_mask(q.size(-2), k.size(-2), window, device=q.device)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)


def cached_attention(q, k, v, window: int | None, q_start: int):
    """Generation with a KV cache: queries at positions ``q_start ..`` over every cached key
    ``0 .. q_start + T_q - 1`` (the same mask as training's causal and windowed attention)."""
    mask = allowed_mask(q.size(-2), k.size(-2), window, q_start=q_start, device=q.device)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=k.size(1) != q.size(1))


def _repeat_kv(x, n_head: int):
    """[B, Hkv, T, D] -> [B, n_head, T, D]; autograd sums the gradient back over each group."""
    groups = n_head // x.size(1)
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


# ---------------------------------------------------------------------------------------------
# chunked: blockwise attention (the FlashAttention algorithm, Dao et al. 2022) in torch ops.
# Autograd through a Python loop would keep every block's scores alive for backward (O(T^2) again),
# so forward saves only the output and the row log-sum-exp, and backward recomputes each block.


def _block_pairs(T: int, block: int, window: int | None):
    """Static (query block, key block, needs_mask) triples that hold at least one allowed pair."""
    starts = range(0, T, block)
    for r0 in starts:
        r1 = min(r0 + block, T)
        for c0 in starts:
            c1 = min(c0 + block, T)
            if c0 > r1 - 1:  # entirely above the diagonal
                continue
            if window is not None and r0 - (c1 - 1) > window:  # entirely left of the window
                continue
            full = c1 - 1 <= r0 and (window is None or (r1 - 1) - c0 <= window)
            yield (r0, r1), (c0, c1), not full


class _ChunkedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, window, block):
        B, H, T, D = q.shape
        scale = 1.0 / math.sqrt(D)
        neg = torch.finfo(q.dtype).min  # finite, so fully-masked rows never produce NaN
        m = q.new_full((B, H, T), neg)
        l = q.new_zeros((B, H, T))
        acc = torch.zeros_like(q)
        for (r0, r1), (c0, c1), needs_mask in _block_pairs(T, block, window):
            s = (q[:, :, r0:r1] @ k[:, :, c0:c1].transpose(-1, -2)) * scale
            if needs_mask:
                mask = allowed_mask(r1 - r0, c1 - c0, window, r0, c0, device=q.device)
                s = s.masked_fill(~mask, neg)
            m_old = m[:, :, r0:r1]
            m_new = torch.maximum(m_old, s.amax(dim=-1))
            p = torch.exp(s - m_new[..., None])
            if needs_mask:
                p = p.masked_fill(~mask, 0.0)
            corr = torch.exp(m_old - m_new)
            l[:, :, r0:r1] = l[:, :, r0:r1] * corr + p.sum(dim=-1)
            acc[:, :, r0:r1] = acc[:, :, r0:r1] * corr[..., None] + p @ v[:, :, c0:c1]
            m[:, :, r0:r1] = m_new
        out = acc / l[..., None]
        lse = m + torch.log(l)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.window, ctx.block = window, block
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        window, block = ctx.window, ctx.block
        T, D = q.size(-2), q.size(-1)
        scale = 1.0 / math.sqrt(D)
        delta = (dout * out).sum(dim=-1)  # rowsum(dO * O) = rowsum(P * dP)
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        for (r0, r1), (c0, c1), needs_mask in _block_pairs(T, block, window):
            qb, kb, vb, dob = q[:, :, r0:r1], k[:, :, c0:c1], v[:, :, c0:c1], dout[:, :, r0:r1]
            p = torch.exp((qb @ kb.transpose(-1, -2)) * scale - lse[:, :, r0:r1, None])
            if needs_mask:
                p = p.masked_fill(~allowed_mask(r1 - r0, c1 - c0, window, r0, c0, q.device), 0.0)
            dv[:, :, c0:c1] += p.transpose(-1, -2) @ dob
            ds = p * (dob @ vb.transpose(-1, -2) - delta[:, :, r0:r1, None])
            dq[:, :, r0:r1] += (ds @ kb) * scale
            dk[:, :, c0:c1] += (ds.transpose(-1, -2) @ qb) * scale
        return dq, dk, dv, None, None


def chunked_attention(q, k, v, window: int | None, block: int):
    k, v = _repeat_kv(k, q.size(1)), _repeat_kv(v, q.size(1))
    return _ChunkedAttention.apply(q, k, v, window, block)


# ---------------------------------------------------------------------------------------------
# TPU kernels. These run only where torch_xla has a TPU; tests check the exact calls on CPU and
# the kernels' numerics through JAX's Pallas interpret mode (tests/test_attention.py).


def flash_call_kwargs(q, partition_spec):
    """Keyword arguments for torch_xla's flash_attention. sm_scale defaults to 1.0 in torch_xla:
    without 1/sqrt(head_dim) the softmax is far too peaked (a known defect of calls that omit it)."""
    kwargs = {"causal": True, "sm_scale": 1.0 / math.sqrt(q.size(-1))}
    if partition_spec is not None:
        kwargs["partition_spec"] = tuple(partition_spec)
    return kwargs


def tpu_flash_attention(q, k, v, partition_spec=None):
    from torch_xla.experimental.custom_kernel import flash_attention

    k, v = _repeat_kv(k, q.size(1)), _repeat_kv(v, q.size(1))
    return flash_attention(q, k, v, **flash_call_kwargs(q, partition_spec))


def splash_call_config(q, window: int | None, mesh, partition_spec):
    """The SplashAttentionConfig for this call: a causal & local (W, W) mask, i.e. keys i-W..i;
    kernel blocks no larger than the sequence; the global mesh and the q/k/v partition spec."""
    from torch_xla.experimental.splash_attention import SplashAttentionConfig

    T, block = q.size(-2), min(SPLASH_BLOCK, q.size(-2))
    blocks = {f"sa_block_{n}": block for n in ("q", "kv", "kv_compute", "q_dkv", "kv_dkv",
                                               "kv_dkv_compute", "q_dq", "kv_dq")}
    spec = tuple(partition_spec) if partition_spec is not None else (BATCH_AXES, None, None, None)
    return SplashAttentionConfig(
        **blocks, mesh=str(mesh), qkv_partition_spec=spec, segment_ids_partition_spec=(spec[0], None),
        attentiontype_local_sliding=window is not None and window < T - 1,
        slide_window_size=window)


def tpu_splash_attention(q, k, v, window: int | None, partition_spec=None):
    import torch_xla.distributed.spmd as xs
    from torch_xla.experimental.splash_attention import splash_attention

    if q.size(-1) % SPLASH_HEAD_DIM:  # (the planner refuses such a config first)
        raise ValueError(f"splash attention needs head_dim % {SPLASH_HEAD_DIM} == 0 "
                         f"(got {q.size(-1)})")
    try:  # what call_jax needs; without it, it asserts "Jax is required" and names nothing
        import torchax  # noqa: F401  (torch_xla's bundled copy; it imports flax)
    except ImportError as e:
        raise ImportError(f"splash attention (windowed layers) on TPU needs torch_xla's torchax, "
                          f"which does not import ({e}): pip install 'xtrain[tpu]'") from e
    k, v = _repeat_kv(k, q.size(1)), _repeat_kv(v, q.size(1))
    cfg = splash_call_config(q, window, xs.get_global_mesh(), partition_spec)
    # The splash kernel applies no softmax scale of its own: scale q (as MaxText does).
    return splash_attention(q * (1.0 / math.sqrt(q.size(-1))), k, v, cfg.to_json(), causal=True)
