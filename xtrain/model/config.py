"""The GPT's shape, without torch: what the model builds, the planner counts, the TPU preflight
traces and a checkpoint's compatibility check compares.

:func:`GPTConfig.from_model` validates the ``model`` config group (its fields are documented in
:class:`xtrain.config.ModelConfig`) and derives the shape: width = depth x aspect ratio, heads =
width / head_dim, per-layer windows from the pattern. Parameter names and shapes are listed
here once (:meth:`GPTConfig.param_shapes`); the model's ``named_parameters`` must equal them
(tests/test_model.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from xtrain.errors import CheckpointError, ConfigError

# Block size of the Pallas splash kernel (queries and keys per tile), capped at the sequence.
SPLASH_BLOCK = 512
SPLASH_HEAD_DIM = 128  # torch_xla's splash kernel takes head_dim in multiples of this


def tpu_kernel(backend: str, window: int | None) -> str | None:
    """The Pallas kernel a layer runs on the TPU (None: not a Pallas backend): flash has no
    sliding windows, so windowed layers of a flash model run splash."""
    if backend not in ("flash", "splash"):
        return None
    return "flash" if backend == "flash" and window is None else "splash"


def parse_window_pattern(pattern: str, n_layer: int, window_len: int) -> tuple[int | None, ...]:
    """Per-layer windows from a pattern tiled over the layers; the last layer is always full.

    nanochat letters: S = sliding (short) window, L = full (long). Another convention writes
    G = global, L = local; a pattern that contains G is read that way (so GL alternates).
    """
    p = pattern.upper()
    if not p or set(p) - set("SLG"):
        raise ConfigError(
            f"model.window_pattern={pattern!r}: use the letters S (sliding window) and L (full "
            "context), e.g. L or SSSL; or G (global) and L (local), e.g. GL")
    if "G" in p and "S" in p:
        raise ConfigError(f"model.window_pattern={pattern!r} mixes S with G: write it as S/L or G/L")
    sliding = "L" if "G" in p else "S"
    windows = [window_len if p[i % len(p)] == sliding else None for i in range(n_layer)]
    windows[-1] = None
    return tuple(windows)


def scan_period(windows) -> tuple[int, int]:
    """(period, scanned periods): the shortest period of the per-layer windows that repeats from
    the first layer, and how many whole periods repeat it (at least 2, else nothing to scan)."""
    n = len(windows)
    for period in range(1, n // 2 + 1):
        repeats = 1
        while (repeats + 1) * period <= n and \
                windows[repeats * period:(repeats + 1) * period] == windows[:period]:
            repeats += 1
        if repeats * period >= n - period and repeats >= 2:
            return period, repeats
    return n, 1


@dataclass(frozen=True)
class GPTConfig:
    n_layer: int
    n_head: int
    n_kv_head: int
    n_embd: int
    vocab_size: int
    sequence_len: int
    windows: tuple[int | None, ...]  # per layer: None = full context, W = sliding window
    attention: str  # a resolved backend: sdpa | chunked | flash | splash
    attention_block: int
    softcap: float
    scan: bool = False  # the XLA engine runs the blocks with torch_xla's scan (see ModelConfig)
    remat: bool = False  # activation checkpointing per block

    @classmethod
    def from_checkpoint(cls, path: str, saved) -> GPTConfig:
        """The network a checkpoint's saved config (``saved``: xtrain/checkpoint/layout.py
        saved_config) describes; a model config that makes none (a field missing, of another
        type, out of range: a crafted or damaged meta.json) refused naming the checkpoint, not as
        this command's config."""
        try:
            return cls.from_model(saved.model, "sdpa")
        except (ConfigError, KeyError, TypeError, ValueError, AttributeError) as e:
            said = " ".join(str(e).split()) or type(e).__name__
            raise CheckpointError(f"{path}: meta.json's model makes no network ({said})") from e

    @classmethod
    def from_model(cls, model, attention: str | None = None) -> GPTConfig:
        """From a resolved ``model`` group (vocab_size and sequence_len set by the planner)."""
        if model.depth < 1:
            raise ConfigError(f"model.depth={model.depth}: must be >= 1")
        width = model.depth * model.aspect_ratio
        if width % model.head_dim:
            raise ConfigError(
                f"model.head_dim={model.head_dim} does not divide the width {width} "
                f"(= model.depth {model.depth} x model.aspect_ratio {model.aspect_ratio})")
        if model.head_dim % 2:
            raise ConfigError(f"model.head_dim={model.head_dim}: rotary embeddings need an even head_dim")
        n_head = width // model.head_dim
        n_kv_head = model.n_kv_head or n_head
        if n_kv_head < 1 or n_head % n_kv_head:
            raise ConfigError(f"model.n_kv_head={model.n_kv_head} must divide n_head={n_head}")
        if model.vocab_size is None or model.sequence_len is None:
            raise ConfigError("model.vocab_size and model.sequence_len must be resolved first")
        window_len = model.window_len or max(1, model.sequence_len // 2)  # (set: >= 1 by its limits)
        backend = attention if attention is not None else model.attention
        return cls(n_layer=model.depth, n_head=n_head, n_kv_head=n_kv_head, n_embd=width,
                   vocab_size=model.vocab_size, sequence_len=model.sequence_len,
                   windows=parse_window_pattern(model.window_pattern, model.depth, window_len),
                   attention=str(getattr(backend, "value", backend)),
                   attention_block=model.attention_block, softcap=model.softcap,
                   scan=bool(model.get("scan")), remat=bool(model.get("remat")))

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    def check_tpu_kernel_shapes(self) -> None:
        """Refuse (the planner, on TPU profiles) what a Pallas kernel would refuse at the first
        step, on the VM."""
        splash = [i for i, w in enumerate(self.windows) if tpu_kernel(self.attention, w) == "splash"]
        if splash and self.head_dim % SPLASH_HEAD_DIM:
            # flash runs only full-context layers as flash: a pattern without windows helps there
            instead = ("model.attention=flash with full-context layers only, or model.attention=sdpa"
                       if self.attention == "splash" else
                       "a model.window_pattern without sliding-window layers, or model.attention=sdpa")
            raise ConfigError(
                f"model.head_dim={self.head_dim}: layers {splash} run splash attention on the TPU "
                f"(model.attention={self.attention}, model.window_pattern), whose kernel takes "
                f"head_dim in multiples of {SPLASH_HEAD_DIM}; use a head_dim of {SPLASH_HEAD_DIM}, "
                f"or {instead}")

    @property
    def kv_dim(self) -> int:
        return self.n_kv_head * self.head_dim

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every parameter's name and shape, as :class:`xtrain.model.gpt.GPT` names them."""
        d, V = self.n_embd, self.vocab_size
        shapes = {"wte.weight": (V, d), "lm_head.weight": (V, d)}
        for i in range(self.n_layer):
            b = f"blocks.{i}."
            shapes.update({b + "attn.c_q.weight": (self.n_head * self.head_dim, d),
                           b + "attn.c_k.weight": (self.kv_dim, d),
                           b + "attn.c_v.weight": (self.kv_dim, d), b + "attn.c_proj.weight": (d, d),
                           b + "mlp.c_fc.weight": (4 * d, d), b + "mlp.c_proj.weight": (d, 4 * d)})
        return shapes

    def param_counts(self) -> dict[str, int]:
        """Parameters by part (embedding, lm_head, attention, mlp, total)."""
        counts = {"embedding": 0, "lm_head": 0, "attention": 0, "mlp": 0}
        for name, shape in self.param_shapes().items():
            part = name.split(".")[0] if not name.startswith("blocks.") else name.split(".")[2]
            counts[{"wte": "embedding", "attn": "attention"}.get(part, part)] += math.prod(shape)
        counts["total"] = sum(counts.values())
        return counts

    def differences(self, other: GPTConfig) -> list[str]:
        """Shape fields that differ (what a checkpoint of ``other`` cannot be loaded into)."""
        keys = ("n_layer", "n_head", "n_kv_head", "n_embd", "vocab_size")
        return [f"{k} {getattr(other, k)} -> {getattr(self, k)}" for k in keys
                if getattr(self, k) != getattr(other, k)]
