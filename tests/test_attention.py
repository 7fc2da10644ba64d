"""Attention backends against a float64 materialised reference (forward and gradients)."""

from __future__ import annotations

import math
import sys

import pytest
import torch

from xtrain.model.attention import attend, reference_attention


def _inputs(B, H, Hkv, T, D, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, h, T, D, generator=g, dtype=torch.float64) for h in (H, Hkv, Hkv)]


CASES = [  # (H, Hkv, T, window, block): causal, GQA, windows, T not a multiple of the block
    (4, 4, 64, None, 16),
    (4, 2, 37, None, 8),
    (4, 1, 50, 7, 16),
    (2, 2, 100, 33, 32),
    (6, 3, 129, 64, 64),
    (2, 2, 20, 200, 8),  # window longer than the sequence: plain causal
]


@pytest.mark.parametrize("backend", ["sdpa", "chunked"])
@pytest.mark.parametrize("H, Hkv, T, window, block", CASES)
def test_backend_matches_float64_reference(backend, H, Hkv, T, window, block):
    q, k, v = _inputs(2, H, Hkv, T, 16)
    ref_in = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = reference_attention(*ref_in, window)
    grad_out = torch.randn_like(ref)
    ref_grads = torch.autograd.grad(ref, ref_in, grad_out)

    ins = [t.float().requires_grad_() for t in (q, k, v)]
    out = attend(*ins, window, backend, block=block)
    grads = torch.autograd.grad(out, ins, grad_out.float())
    assert (out.double() - ref).abs().max() < 2e-5
    for g, r in zip(grads, ref_grads):
        assert g.shape == r.shape
        assert (g.double() - r).abs().max() < 5e-5


def test_chunked_reference_window_is_w_plus_one_keys():
    # query i sees keys i-W..i: perturbing key i-W-1 must not change output i
    T, W = 40, 5
    q, k, v = [t.float() for t in _inputs(1, 1, 1, T, 8)]
    out = attend(q, k, v, W, "chunked", block=8)
    k2, v2 = k.clone(), v.clone()
    k2[:, :, 20 - W - 1] += 10
    v2[:, :, 20 - W - 1] += 10
    out2 = attend(q, k2, v2, W, "chunked", block=8)
    assert torch.equal(out[:, :, 20], out2[:, :, 20])
    k2[:, :, 20 - W] += 10
    assert not torch.equal(out[:, :, 20], attend(q, k2, v2, W, "chunked", block=8)[:, :, 20])


def test_unknown_backend_is_refused():
    q, k, v = [t.float() for t in _inputs(1, 1, 1, 8, 8)]
    with pytest.raises(ValueError, match="model.attention='nope'"):
        attend(q, k, v, None, "nope")


# --- TPU kernels: the exact calls (mocked: torch_xla's Pallas kernels need a TPU) -------------


@pytest.fixture
def recorded_kernels(monkeypatch):
    """Replace torch_xla's kernel entry points with recorders. A mock only because the kernels
    cannot execute on CPU through torch_xla ("Only interpret mode is supported on CPU backend")."""
    custom_kernel = pytest.importorskip("torch_xla.experimental.custom_kernel")
    import numpy as np
    import torch_xla.distributed.spmd as xs
    import torch_xla.experimental.splash_attention as sa

    calls = {}

    def fake_flash(q, k, v, causal=False, q_segment_ids=None, kv_segment_ids=None, sm_scale=1.0, *,
                   ab=None, partition_spec=None, mesh=None):
        calls["flash"] = dict(q=q, k=k, v=v, causal=causal, sm_scale=sm_scale,
                              partition_spec=partition_spec, mesh=mesh)
        return q

    def fake_splash(q, k, v, config, decoder_segment_ids=None, causal=True, attn_logits_soft_cap=None):
        calls["splash"] = dict(q=q, k=k, v=v, config=sa.SplashAttentionConfig.from_json(config),
                               causal=causal)
        return q

    monkeypatch.setattr(custom_kernel, "flash_attention", fake_flash)
    monkeypatch.setattr(sa, "splash_attention", fake_splash)
    mesh = xs.Mesh(np.arange(1), (1, 1, 1), ("data", "fsdp", "tensor"))
    monkeypatch.setattr(xs, "get_global_mesh", lambda: mesh)
    return calls, mesh


def test_flash_call_uses_correct_scale_spec_and_full_heads(recorded_kernels):
    calls, _ = recorded_kernels
    q, k, v = [t.float() for t in _inputs(2, 8, 2, 256, 128)]
    spec = (("data", "fsdp"), "tensor", None, None)
    attend(q, k, v, None, "flash", partition_spec=spec)
    call = calls["flash"]
    assert call["causal"] is True
    assert call["sm_scale"] == pytest.approx(1 / math.sqrt(128))  # not torch_xla's default 1.0
    assert call["partition_spec"] == spec
    assert call["k"].shape == (2, 8, 256, 128) and call["v"].shape == (2, 8, 256, 128)  # GQA expanded
    assert torch.equal(call["k"][:, 3], k[:, 0 + 3 // 4]) and torch.equal(call["k"][:, 4], k[:, 1])


def test_windowed_layers_use_splash_with_local_mask(recorded_kernels):
    pytest.importorskip("torchax", reason="torch_xla's torchax does not import: flax missing "
                        "(pip install 'xtrain[tpu]')")  # splash refuses to run without it
    calls, mesh = recorded_kernels
    q, k, v = [t.float() for t in _inputs(1, 2, 2, 1024, 128)]
    spec = (("data", "fsdp"), None, None, None)
    attend(q, k, v, 256, "flash", partition_spec=spec)  # flash has no windows: routed to splash
    call = calls["splash"]
    cfg = call["config"]
    assert cfg.attentiontype_local_sliding and cfg.slide_window_size == 256
    assert cfg.qkv_partition_spec == spec and cfg.mesh == str(mesh)
    assert cfg.sa_block_q == 512 and cfg.sa_block_kv == 512
    assert call["causal"] is True
    assert torch.allclose(call["q"], q / math.sqrt(128))  # splash applies no scale itself


def test_splash_refuses_small_head_dim(recorded_kernels):
    q, k, v = [t.float() for t in _inputs(1, 2, 2, 64, 64)]
    with pytest.raises(ValueError, match="head_dim % 128"):
        attend(q, k, v, 16, "splash")


def test_splash_without_torchax_names_the_missing_package(recorded_kernels, monkeypatch):
    """torch_xla's splash goes through call_jax, which fails with "Jax is required" when torchax
    does not import (hidden here; torch_xla ships it, the tpu extra installs the flax it needs)."""
    monkeypatch.setitem(sys.modules, "torchax", None)  # import torchax -> ImportError
    calls, _ = recorded_kernels
    q, k, v = [t.float() for t in _inputs(1, 2, 2, 256, 128)]
    with pytest.raises(ImportError, match="needs torch_xla.s torchax"):
        attend(q, k, v, 64, "splash")
    assert "splash" not in calls


# --- the kernels' numerics, in JAX's Pallas TPU interpret mode on CPU ------------------------


def _jax():
    jax = pytest.importorskip("jax", reason="the tpu extra (jax 0.7.0) is not installed")
    jax.config.update("jax_enable_x64", False)
    return jax


def test_pallas_flash_kernel_matches_reference_in_interpret_mode():
    jax = _jax()
    import jax.numpy as jnp
    from jax.experimental.pallas import tpu as pltpu
    from jax.experimental.pallas.ops.tpu.flash_attention import flash_attention

    q, k, v = _inputs(1, 2, 2, 256, 64, seed=1)
    scale = 1 / math.sqrt(64)
    qj, kj, vj = (jnp.asarray(t.float().numpy()) for t in (q, k, v))
    with pltpu.force_tpu_interpret_mode():
        out = flash_attention(qj, kj, vj, causal=True, sm_scale=scale)
        dq = jax.grad(lambda q_: flash_attention(q_, kj, vj, causal=True, sm_scale=scale).sum())(qj)
    ref_q = q.clone().requires_grad_()
    ref = reference_attention(ref_q, k, v, None)
    (ref_dq,) = torch.autograd.grad(ref.sum(), ref_q)
    assert abs(torch.from_numpy(jax.device_get(out).copy()).double() - ref).max() < 1e-5
    assert abs(torch.from_numpy(jax.device_get(dq).copy()).double() - ref_dq).max() < 1e-4


def test_pallas_splash_kernel_with_our_mask_and_blocks_matches_reference():
    jax = _jax()
    import jax.numpy as jnp
    from jax.experimental.pallas import tpu as pltpu
    from jax.experimental.pallas.ops.tpu.splash_attention import (splash_attention_kernel as sk,
                                                                  splash_attention_mask as sm)

    H, T, D, W = 2, 512, 128, 128
    q, k, v = _inputs(1, H, H, T, D, seed=2)
    # exactly the mask torch_xla builds from our SplashAttentionConfig
    mask = sm.CausalMask(shape=(T, T)) & sm.LocalMask(shape=(T, T), window_size=(W, W), offset=0)
    block = min(512, T)  # xtrain's block choice (splash_call_config)
    sizes = sk.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block, block_q_dkv=block,
                          block_kv_dkv=block, block_kv_dkv_compute=block, use_fused_bwd_kernel=True)
    with pltpu.force_tpu_interpret_mode():
        kernel = sk.make_splash_mha(mask=sm.MultiHeadMask(masks=(mask,) * H), head_shards=1,
                                    q_seq_shards=1, block_sizes=sizes)
        qj, kj, vj = (jnp.asarray(t[0].float().numpy()) for t in (q, k, v))
        out = kernel(qj / math.sqrt(D), kj, vj)
    ref = reference_attention(q, k, v, W)[0]
    assert abs(torch.from_numpy(jax.device_get(out).copy()).double() - ref).max() < 1e-5
