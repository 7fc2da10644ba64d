"""A nanochat-style GPT.

Rotary position embeddings, QK-norm, parameter-free RMSNorm, relu^2 MLP, untied embedding and
head, logit softcap, no biases, optional GQA and per-layer sliding windows. Depth is the one size
dial: width = depth * aspect_ratio, heads = width / head_dim.

The shape lives in :class:`xtrain.model.config.GPTConfig` (torch-free). The model knows nothing
about sharding or devices: the engines place and shard it. Generation, with a KV cache, is in
xtrain/model/generate.py.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from xtrain.model.attention import attend, cached_attention
from xtrain.model.config import GPTConfig
from xtrain.model.loss import softcap, softcap_cross_entropy


def norm(x):
    return F.rms_norm(x, (x.size(-1),))


def rotary_tables(seq_len: int, head_dim: int, base: float = 10000.0):
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv_freq)
    return angles.cos()[None, None], angles.sin()[None, None]  # [1, 1, T, D/2]


def apply_rotary(x, cos, sin):
    d = x.size(-1) // 2
    x1, x2 = x[..., :d], x[..., d:]
    return torch.cat([x1 * cos + x2 * sin, x2 * cos - x1 * sin], dim=-1)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig, window: int | None):
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = config.n_head, config.n_kv_head, config.head_dim
        self.window = window
        self.backend, self.block = config.attention, config.attention_block
        self.partition_spec = None  # set by the XLA engine for the flash kernel's SPMD call
        d = config.n_embd
        self.c_q = nn.Linear(d, self.n_head * self.head_dim, bias=False)
        self.c_k = nn.Linear(d, self.n_kv_head * self.head_dim, bias=False)
        self.c_v = nn.Linear(d, self.n_kv_head * self.head_dim, bias=False)
        self.c_proj = nn.Linear(d, d, bias=False)

    def forward(self, x, cos, sin, cache=None):
        """``cache``: this layer's keys and values of earlier positions (generation); the new
        ones are appended to it."""
        B, T, C = x.shape
        q = self.c_q(x).view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        k = self.c_k(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        v = self.c_v(x).view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        q, k = norm(apply_rotary(q, cos, sin)), norm(apply_rotary(k, cos, sin))  # QK-norm
        # torch_xla's autocast runs rms_norm in float32: attend in the projections' dtype
        q, k = q.to(v.dtype), k.to(v.dtype)
        if cache is not None:
            start = cache.length
            k, v = cache.extend(k, v)
            y = cached_attention(q, k, v, self.window, start)
        else:
            y = attend(q, k, v, self.window, self.backend, self.block, self.partition_spec)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, C))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=False)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=False)

    def forward(self, x):
        return self.c_proj(F.relu(self.c_fc(x)).square())


class Block(nn.Module):
    def __init__(self, config: GPTConfig, window: int | None):
        super().__init__()
        self.attn = CausalSelfAttention(config, window)
        self.mlp = MLP(config)

    def forward(self, x, cos, sin, cache=None):
        x = x + self.attn(norm(x), cos, sin, cache)
        return x + self.mlp(norm(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.blocks = nn.ModuleList(Block(config, w) for w in config.windows)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        cos, sin = rotary_tables(config.sequence_len, config.head_dim)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        # How the blocks run: None is the loop in run_blocks; an engine may install another
        # callable (x, cos, sin) -> x over the same blocks (the XLA engine's scan,
        # xtrain/xla/layers.py). Not a module, so parameter names never depend on it.
        self.layer_loop = None
        self.init_weights()

    @classmethod
    def from_weights(cls, config: GPTConfig, weights: dict) -> "GPT":
        """A CPU model holding copies of ``weights`` (a full state dict), built without random
        initialisation: no time spent on it, and the global RNG (which a training thread may be
        using) untouched."""
        with torch.device("meta"):
            model = cls(config)
        model = model.to_empty(device="cpu")
        model.load_state_dict(weights)
        with torch.no_grad():  # the rotary tables are not in a state dict
            model.cos, model.sin = rotary_tables(config.sequence_len, config.head_dim)
        return model

    @torch.no_grad()
    def init_weights(self):
        """nanochat's scheme: embedding ~ N(0, 1); lm_head ~ N(0, 0.001); attention and MLP input
        matrices ~ U(-a, a) with a = sqrt(3 / width) (unit-variance outputs); every output
        projection (attn.c_proj, mlp.c_proj) zero, so each block starts as the identity."""
        nn.init.normal_(self.wte.weight, std=1.0)
        nn.init.normal_(self.lm_head.weight, std=0.001)
        bound = math.sqrt(3.0 / self.config.n_embd)
        for block in self.blocks:
            for lin in (block.attn.c_q, block.attn.c_k, block.attn.c_v, block.mlp.c_fc):
                nn.init.uniform_(lin.weight, -bound, bound)
            nn.init.zeros_(block.attn.c_proj.weight)
            nn.init.zeros_(block.mlp.c_proj.weight)

    def forward(self, idx, targets=None, kv_cache=None):
        """Logits [B, T, V], or the mean loss given ``targets``. With ``kv_cache``
        (xtrain/model/generate.py) ``idx`` continues the cached positions."""
        T = idx.size(1)
        start = kv_cache.length if kv_cache is not None else 0
        cos, sin = self.cos[:, :, start:start + T], self.sin[:, :, start:start + T]
        x = norm(self.wte(idx))
        if kv_cache is None:
            x = self.run_blocks(x, cos, sin)
        else:  # generation: block by block with its cache (never scanned nor rematerialised)
            for block, layer_cache in zip(self.blocks, kv_cache.layers):
                x = block(x, cos, sin, layer_cache)
        x = norm(x)
        if targets is None:
            return softcap(self.lm_head(x).float(), self.config.softcap)
        return softcap_cross_entropy(x, self.lm_head.weight, targets, self.config.softcap)

    def run_blocks(self, x, cos, sin):
        if self.layer_loop is not None:
            return self.layer_loop(x, cos, sin)
        remat = self.config.remat and torch.is_grad_enabled()
        for block in self.blocks:
            if remat:  # keep only the block's input; recompute its activations in backward
                x = checkpoint(block, x, cos, sin, use_reentrant=False)
            else:
                x = block(x, cos, sin)
        return x

    def param_groups(self):
        """(matrices for Muon, embedding, head) — the split nanochat's optimiser uses."""
        matrices = [p for p in self.blocks.parameters()]
        return matrices, [self.wte.weight], [self.lm_head.weight]
