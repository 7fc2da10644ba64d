"""Derived numbers, as pure functions of the config: model shape, parameters, FLOPs, batch
arithmetic. Everything a run derives is computed here, once, printed, and checked; bad values are
refused with the arithmetic shown (:class:`xtrain.config.ConfigError`).

FLOPs convention (used for MFU): a training token costs 6 FLOPs per matmul parameter (2 forward,
4 backward; the embedding lookup is not a matmul, the lm_head is) plus attention's two matmuls,
QK^T and PV, 2 * 2 * head_dim FLOPs per head per *attended key*, times 3 for forward+backward.
Attended keys are counted honestly: a causal query at position i sees i + 1 keys, a windowed one
min(i, W) + 1, averaged over the sequence. (nanochat and the user's old numbers count all T keys
for every query, which doubles attention FLOPs and inflates MFU at long context.)
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from xtrain.config import ConfigError

ATTENTION_CHOICES = ("auto", "sdpa", "chunked", "flash", "splash")


def parse_window_pattern(pattern: str, n_layer: int, window_len: int) -> tuple[int | None, ...]:
    """Per-layer windows from a pattern tiled over the layers; the last layer is always full.

    nanochat letters: S = sliding (short) window, L = full (long). The user's notes write
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


def gpt_config(model, attention: str):
    """The model's own config (:class:`xtrain.model.gpt.GPTConfig`) from a resolved ``model`` group."""
    from xtrain.model.gpt import GPTConfig  # torch-free callers use model_shape()

    return GPTConfig(**model_shape(model), attention=attention)


def model_shape(model) -> dict:
    """Validated shape fields of the GPT (no torch): n_layer, n_head, n_kv_head, n_embd, ..."""
    if model.depth < 1:
        raise ConfigError(f"model.depth={model.depth}: must be >= 1")
    width = model.depth * model.aspect_ratio
    if width % model.head_dim:
        raise ConfigError(
            f"model.head_dim={model.head_dim} does not divide the width {width} "
            f"(= model.depth {model.depth} x model.aspect_ratio {model.aspect_ratio})")
    n_head = width // model.head_dim
    if model.head_dim % 2:
        raise ConfigError(f"model.head_dim={model.head_dim}: rotary embeddings need an even head_dim")
    n_kv_head = model.n_kv_head or n_head
    if n_kv_head < 1 or n_head % n_kv_head:
        raise ConfigError(f"model.n_kv_head={model.n_kv_head} must divide n_head={n_head}")
    if model.vocab_size is None or model.sequence_len is None:
        raise ConfigError("model.vocab_size and model.sequence_len must be resolved first")
    window_len = model.window_len or model.sequence_len // 2
    if window_len < 1:
        raise ConfigError(f"model.window_len={model.window_len}: must be >= 1")
    return dict(
        n_layer=model.depth, n_head=n_head, n_kv_head=n_kv_head, n_embd=width,
        vocab_size=model.vocab_size, sequence_len=model.sequence_len,
        windows=parse_window_pattern(model.window_pattern, model.depth, window_len),
        attention_block=model.attention_block, softcap=model.softcap)


def param_counts(shape: dict) -> dict[str, int]:
    """Parameters by part; equals the instantiated model's numel (tested)."""
    d, V, L = shape["n_embd"], shape["vocab_size"], shape["n_layer"]
    kv = shape["n_kv_head"] * (d // shape["n_head"])
    attention = L * (d * d + 2 * d * kv + d * d)  # c_q, c_k, c_v, c_proj
    mlp = L * (2 * 4 * d * d)  # c_fc, c_proj
    counts = {"embedding": V * d, "lm_head": d * V, "attention": attention, "mlp": mlp}
    counts["total"] = sum(counts.values())
    return counts


def mean_attended_keys(T: int, window: int | None) -> float:
    """Average keys a query attends to over positions 0..T-1 (causal, optionally windowed)."""
    if window is None or window >= T - 1:
        return (T + 1) / 2
    # positions 0..W see i + 1 keys; the rest see W + 1
    head = (window + 1) * (window + 2) / 2
    return (head + (T - window - 1) * (window + 1)) / T


def flops_per_token(shape: dict) -> float:
    """Training FLOPs per token (forward + backward), with the convention in the module docstring."""
    counts = param_counts(shape)
    matmul_params = counts["total"] - counts["embedding"]
    head_dim = shape["n_embd"] // shape["n_head"]
    attn = sum(12 * shape["n_head"] * head_dim * mean_attended_keys(shape["sequence_len"], w)
               for w in shape["windows"])
    return 6 * matmul_params + attn


def choose_attention(requested: str, engine: str, on_tpu: bool, seq_len: int) -> str:
    """``auto``: Pallas flash attention on TPU from 4K context (the user's measured crossover:
    below it XLA's fused SDPA was as fast); the chunked kernel for long context elsewhere (memory);
    torch SDPA otherwise."""
    if requested not in ATTENTION_CHOICES:
        raise ConfigError(f"model.attention={requested!r}: expected one of {ATTENTION_CHOICES}")
    if requested != "auto":
        if requested in ("flash", "splash") and not on_tpu:
            raise ConfigError(f"model.attention={requested}: the Pallas kernels need a TPU "
                              f"(engine={engine}); use sdpa or chunked")
        return requested
    if on_tpu:
        return "flash" if seq_len >= 4096 else "sdpa"
    return "chunked" if seq_len >= 8192 else "sdpa"


@dataclass
class BatchPlan:
    device_batch_size: int  # sequences per device per micro-batch
    sequence_len: int
    data_parallel: int  # devices the batch is split over (data x fsdp axes, or DDP world size)
    tokens_per_micro_step: int
    total_batch_size: int  # tokens per optimizer step
    grad_accum_steps: int

    def describe(self) -> str:
        return (f"grad_accum_steps = total_batch_size {self.total_batch_size:,} / (device_batch "
                f"{self.device_batch_size} x seq {self.sequence_len} x data-parallel "
                f"{self.data_parallel}) = {self.grad_accum_steps}")


def batch_plan(device_batch_size: int, sequence_len: int, data_parallel: int,
               total_batch_size: int | None) -> BatchPlan:
    per_micro = device_batch_size * sequence_len * data_parallel
    total = total_batch_size or per_micro
    if total % per_micro:
        raise ConfigError(
            f"trainer.total_batch_size={total:,} is not a multiple of device_batch "
            f"{device_batch_size} x seq {sequence_len} x data-parallel {data_parallel} = "
            f"{per_micro:,} tokens per micro-step ({total:,} / {per_micro:,} = {total / per_micro:.3f})")
    return BatchPlan(device_batch_size, sequence_len, data_parallel, per_micro, total, total // per_micro)


def default_device_batch(device_tokens: int, sequence_len: int) -> int:
    """The hardware profile's tokens per device per micro-batch, in whole sequences (>= 1)."""
    return max(1, device_tokens // sequence_len)


def max_steps(explicit: int | None, tokens_per_param: float | None, params: int, total_batch: int) -> int:
    if explicit is not None:
        if explicit < 1:
            raise ConfigError(f"trainer.max_steps={explicit}: must be >= 1")
        return explicit
    if tokens_per_param is None:
        raise ConfigError("set trainer.max_steps or trainer.target_tokens_per_param")
    return max(1, math.ceil(tokens_per_param * params / total_batch))


def as_dict(plan) -> dict:
    return asdict(plan)


@dataclass
class RunPlan:
    """What a run derives from its config; printed before training."""

    devices: int
    params: dict
    flops_per_token: float
    batch: BatchPlan
    max_steps: int
    attention: str

    @property
    def total_tokens(self) -> int:
        return self.max_steps * self.batch.total_batch_size

    def describe(self) -> str:
        p = self.params
        return "\n".join([
            f"parameters: {p['total']:,} (embedding {p['embedding']:,}, lm_head {p['lm_head']:,}, "
            f"attention {p['attention']:,}, mlp {p['mlp']:,})",
            f"FLOPs/token (train): {self.flops_per_token:.4g}   attention backend: {self.attention}",
            f"devices: {self.devices}   {self.batch.describe()}",
            f"steps: {self.max_steps:,} x {self.batch.total_batch_size:,} tokens = {self.total_tokens:,} "
            f"tokens ({self.total_tokens / p['total']:.2f} tokens/param)",
        ])


def resolve(cfg, devices: int) -> RunPlan:
    """Fill the config's derived (None) fields in place and return the run's plan.

    Precedence for the sequence length: model.sequence_len, else data.sequence_len, else the
    hardware profile's; for the per-device batch: trainer.device_batch_size, else the profile's
    tokens per device divided by the sequence length.
    """
    model, data, hw, trainer = cfg.model, cfg.data, cfg.hardware, cfg.trainer
    if cfg.mode not in ("train", "plan", "sample", "eval"):
        raise ConfigError(f"mode={cfg.mode!r}: expected one of train, plan, sample, eval")
    if model.vocab_size is None:
        model.vocab_size = data.vocab_size
    elif model.vocab_size != data.vocab_size:
        raise ConfigError(f"model.vocab_size={model.vocab_size} disagrees with the tokenizer of "
                          f"data={data.name} (data.vocab_size={data.vocab_size})")
    if model.sequence_len is None:
        model.sequence_len = data.sequence_len or hw.sequence_len
    shape = model_shape(model)
    on_tpu = hw.engine == "xla" and bool(hw.accelerator_type)
    model.attention = choose_attention(model.attention, hw.engine, on_tpu, model.sequence_len)
    if trainer.device_batch_size is None:
        trainer.device_batch_size = default_device_batch(hw.device_tokens, model.sequence_len)
    if trainer.log_every < 1:
        raise ConfigError(f"trainer.log_every={trainer.log_every}: must be >= 1")
    batch = batch_plan(trainer.device_batch_size, model.sequence_len, devices, trainer.total_batch_size)
    params = param_counts(shape)
    steps = max_steps(trainer.max_steps, trainer.target_tokens_per_param, params["total"],
                      batch.total_batch_size)
    trainer.max_steps = steps
    return RunPlan(devices, params, flops_per_token(shape), batch, steps, model.attention)
