"""Model family: shapes from depth, hand-computed parameter counts, FLOPs convention, bad input."""

from __future__ import annotations

import pytest
import torch

from xtrain.engines.step import autocast
from xtrain.errors import ConfigError
from xtrain.model.config import GPTConfig, parse_window_pattern
from xtrain.model.gpt import GPT
from xtrain.plan import flops_per_token, mean_attended_keys

# 2 * V * d (embedding + untied head) + L * 12 * d^2 (q, k, v, proj = 4 d^2; MLP = 8 d^2), V = 65536.
HAND_COUNTED = {
    "d12": 2 * 65536 * 768 + 12 * 12 * 768**2,  # 185,597,952
    "d16": 2 * 65536 * 1024 + 16 * 12 * 1024**2,  # 335,544,320
    "d20": 2 * 65536 * 1280 + 20 * 12 * 1280**2,  # 560,988,160
    "d26": 2 * 65536 * 1664 + 26 * 12 * 1664**2,  # 1,081,999,360
}


def _model_cfg(compose_config, name, *extra):
    cfg = compose_config([f"model={name}", "model.vocab_size=4096", *extra])
    cfg.model.vocab_size, cfg.model.sequence_len = 65536, 2048
    return cfg.model


@pytest.mark.parametrize("name", sorted(HAND_COUNTED))
def test_param_counts_match_hand_count_and_numel(name, compose_config):
    model_cfg = _model_cfg(compose_config, name)
    gpt = GPTConfig.from_model(model_cfg, "sdpa")
    counts = gpt.param_counts()
    assert counts["total"] == HAND_COUNTED[name]
    assert counts["total"] == [185_597_952, 335_544_320, 560_988_160, 1_081_999_360][
        sorted(HAND_COUNTED).index(name)]
    with torch.device("meta"):  # no memory: only shapes
        model = GPT(gpt)
    assert sum(p.numel() for p in model.parameters()) == counts["total"]
    assert {n: tuple(p.shape) for n, p in model.named_parameters()} == gpt.param_shapes()


def test_depth_sets_width_and_heads(compose_config):
    gpt = GPTConfig.from_model(_model_cfg(compose_config, "d16"))
    assert (gpt.n_embd, gpt.n_head, gpt.n_kv_head) == (1024, 8, 8)
    gpt = GPTConfig.from_model(_model_cfg(compose_config, "d26", "model.n_kv_head=1"))
    assert (gpt.n_embd, gpt.n_head, gpt.n_kv_head) == (1664, 13, 1)


def test_gqa_param_count_is_instantiated_numel(compose_config):
    cfg = _model_cfg(compose_config, "d2", "model.n_kv_head=2")
    cfg.vocab_size = 512
    with torch.device("meta"):
        model = GPT(GPTConfig.from_model(cfg, "sdpa"))
    assert sum(p.numel() for p in model.parameters()) == GPTConfig.from_model(cfg).param_counts()["total"]


def test_window_patterns():
    assert parse_window_pattern("L", 4, 100) == (None, None, None, None)
    assert parse_window_pattern("SSSL", 6, 100) == (100, 100, 100, None, 100, None)
    # the G/L notation: G = global, L = local
    assert parse_window_pattern("GL", 4, 100) == (None, 100, None, None)
    for bad in ("SXL", "", "GS"):
        with pytest.raises(ConfigError, match="model.window_pattern"):
            parse_window_pattern(bad, 4, 100)


@pytest.mark.parametrize("override, message", [
    ("model.window_pattern=SQL", "model.window_pattern"),
    ("model.head_dim=48", "model.head_dim=48 does not divide the width 256"),
    ("model.n_kv_head=3", "model.n_kv_head=3 must divide n_head=4"),
])
def test_bad_shapes_name_the_field(override, message, compose_config):
    cfg = _model_cfg(compose_config, "d4", override)
    with pytest.raises(ConfigError, match=message):
        GPTConfig.from_model(cfg)


def test_attention_flops_are_causal_and_windowed():
    T = 1024
    assert mean_attended_keys(T, None) == (T + 1) / 2  # half of T^2, not all of it
    assert mean_attended_keys(T, 2000) == (T + 1) / 2
    W = 127  # brute force: query i sees min(i, W) + 1 keys
    assert mean_attended_keys(T, W) == pytest.approx(sum(min(i, W) + 1 for i in range(T)) / T)
    base = dict(n_layer=2, n_head=4, n_kv_head=4, n_embd=256, vocab_size=1000, sequence_len=T,
                attention="sdpa", attention_block=512, softcap=15.0)
    full = flops_per_token(GPTConfig(**base, windows=(None, None)))
    windowed = flops_per_token(GPTConfig(**base, windows=(W, None)))
    # matmul parameters: 2 layers x 12 d^2 + the lm_head (the embedding lookup is no matmul)
    matmul = 6 * (2 * 12 * 256**2 + 1000 * 256)
    assert full - matmul == pytest.approx(2 * 12 * 4 * 64 * (T + 1) / 2)
    assert windowed < full


def test_forward_shapes_loss_and_init(compose_config):
    cfg = _model_cfg(compose_config, "d2")
    cfg.vocab_size, cfg.sequence_len = 300, 32
    torch.manual_seed(0)
    model = GPT(GPTConfig.from_model(cfg, "sdpa"))
    idx = torch.randint(0, 300, (2, 32))
    logits = model(idx)
    assert logits.shape == (2, 32, 300) and logits.abs().max() <= 15.0  # softcap
    loss = model(idx, idx)
    # zero-initialised output projections + tiny head: the initial loss is ~ln(vocab)
    assert abs(loss.item() - torch.log(torch.tensor(300.0)).item()) < 0.1
    for block in model.blocks:
        assert block.attn.c_proj.weight.abs().sum() == 0 and block.mlp.c_proj.weight.abs().sum() == 0
    assert not any(m.bias is not None for m in model.modules() if isinstance(m, torch.nn.Linear))


def test_bfloat16_profiles_compute_matmuls_in_bfloat16(compose_config):
    from xtrain.train.module import GPTModule

    cfg = _model_cfg(compose_config, "d2")
    cfg.vocab_size, cfg.sequence_len = 300, 16
    for precision, dtype in (("bfloat16", torch.bfloat16), ("float32", torch.float32)):
        module = GPTModule(GPTConfig.from_model(cfg, "sdpa"), compose_config().optim, 10,
                           precision=precision)
        x = torch.randn(2, 16, 128)  # d2: width 128
        with autocast("cpu", precision):
            assert module.model.lm_head(x).dtype == dtype
            assert module.model(torch.zeros(2, 16, dtype=torch.long)).dtype == torch.float32  # loss math
