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
from dataclasses import dataclass

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
    """``auto``: on TPU, Pallas flash attention from 2K context. The user measured XLA's SDPA as
    fast as flash below 4K, but SDPA materialises [B, H, T, T] scores: the TPU compiler puts the
    d16 step at 2048 x 8 on v6e at >= 34 GiB per chip with SDPA (it does not fit), while the
    same step with flash/splash needs less than half (BENCHMARKS.md). SDPA below 2K. Elsewhere
    the chunked kernel for long context (memory), torch SDPA otherwise."""
    if requested not in ATTENTION_CHOICES:
        raise ConfigError(f"model.attention={requested!r}: expected one of {ATTENTION_CHOICES}")
    if requested != "auto":
        if requested in ("flash", "splash") and not on_tpu:
            raise ConfigError(f"model.attention={requested}: the Pallas kernels need a TPU "
                              f"(engine={engine}); use sdpa or chunked")
        return requested
    if on_tpu:
        return "flash" if seq_len >= 2048 else "sdpa"
    return "chunked" if seq_len >= 8192 else "sdpa"


def param_shapes(shape: dict) -> dict[str, tuple[int, ...]]:
    """Every parameter's name and shape, as :class:`xtrain.model.gpt.GPT` names them (tested)."""
    d, V, hd = shape["n_embd"], shape["vocab_size"], shape["n_embd"] // shape["n_head"]
    q, kv = shape["n_head"] * hd, shape["n_kv_head"] * hd
    shapes = {"wte.weight": (V, d), "lm_head.weight": (V, d)}
    for i in range(shape["n_layer"]):
        b = f"blocks.{i}."
        shapes.update({b + "attn.c_q.weight": (q, d), b + "attn.c_k.weight": (kv, d),
                       b + "attn.c_v.weight": (kv, d), b + "attn.c_proj.weight": (d, d),
                       b + "mlp.c_fc.weight": (4 * d, d), b + "mlp.c_proj.weight": (d, 4 * d)})
    return shapes


GIB = 1024**3


@dataclass
class MemoryPlan:
    """Estimated bytes per chip; the formulas are in :func:`memory_per_chip`."""

    weights: float
    grads: float
    optimizer: float
    activations: float
    hbm: float  # bytes per chip; 0: not checked (host memory)

    @property
    def total(self) -> float:
        return self.weights + self.grads + self.optimizer + self.activations

    @property
    def fits(self) -> bool:
        return not self.hbm or self.total <= self.hbm

    def describe(self) -> str:
        parts = ", ".join(f"{k} {getattr(self, k) / GIB:.2f}" for k in
                          ("weights", "grads", "optimizer", "activations"))
        cap = f" of {self.hbm / GIB:.0f} GiB HBM ({self.total / self.hbm:.0%})" if self.hbm else ""
        return f"memory/chip: {self.total / GIB:.2f} GiB{cap} = {parts} GiB"


def memory_per_chip(shape: dict, specs: dict, mesh: dict, device_batch: int, attention: str,
                    precision: str, hbm_gib: float) -> MemoryPlan:
    """Per-chip memory of one training step, estimated term by term:

    - weights: sum over parameters of numel / shard_ways * 4 B (float32 master weights)
    - grads: the same as weights (float32 gradients, sharded like their parameters)
    - optimizer: Muon matrices numel / ways * 4 B (momentum); AdamW embedding/head * 8 B (m, v)
    - activations, saved for backward, for one micro-batch of device_batch * T tokens:
      per token per layer a * (4d + (10d + 2 kv_dim) / tp) where a = 2 B (bf16) or 4 B: residual
      and normed inputs of attention and MLP (4d, replicated over tensor), q (d), k and v
      (2 kv_dim), attention output (d), MLP hidden before and after relu^2 (8d) (split over
      tensor); plus, when attention is materialised (sdpa), the saved probabilities
      a * n_head * T / tp per token per layer (chunked: one block, a * n_head * block; flash and
      splash: none); plus the logits, 8 B * V / tp per token (float32 logits and their gradient;
      the softcap fuses into them).
    Not counted: XLA's temporaries, fragmentation, and its rematerialisation (which can lower the
    real peak). Compiling for the target (mode=compile) gives the compiler's own figure;
    BENCHMARKS.md compares the two.
    """
    from xtrain.parallelism import shard_ways

    tp = mesh.get("tensor", 1)
    weights = optimizer = 0.0
    for name, dims in param_shapes(shape).items():
        numel = math.prod(dims) / shard_ways(specs.get(name), mesh)
        weights += 4 * numel
        optimizer += (8 if name in ("wte.weight", "lm_head.weight") else 4) * numel
    d, T, H = shape["n_embd"], shape["sequence_len"], shape["n_head"]
    kv_dim = shape["n_kv_head"] * (d // H)
    a = 2 if precision == "bfloat16" else 4
    per_layer = a * (4 * d + (10 * d + 2 * kv_dim) / tp)
    if attention == "sdpa":
        per_layer += a * H * T / tp
    elif attention == "chunked":
        per_layer += a * H * min(shape["attention_block"], T) / tp
    per_token = shape["n_layer"] * per_layer + 8 * shape["vocab_size"] / tp
    activations = device_batch * T * per_token
    return MemoryPlan(weights, weights, optimizer, activations, hbm_gib * GIB)


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



@dataclass
class RunPlan:
    """What a run derives from its config; printed before training and checked."""

    devices: int  # all devices of the run (chips, virtual CPU devices, or CPU hosts)
    mesh: dict
    params: dict
    flops_per_token: float
    batch: BatchPlan
    max_steps: int
    attention: str
    memory: MemoryPlan
    step_seconds: float  # at the profile's expected MFU; 0 when the peak is unknown
    hourly_usd: tuple[float, float]  # (spot, on demand) for the whole slice

    @property
    def total_tokens(self) -> int:
        return self.max_steps * self.batch.total_batch_size

    def describe(self) -> str:
        p = self.params
        lines = [
            f"parameters: {p['total']:,} (embedding {p['embedding']:,}, lm_head {p['lm_head']:,}, "
            f"attention {p['attention']:,}, mlp {p['mlp']:,})",
            f"FLOPs/token (train): {self.flops_per_token:.4g}   attention backend: {self.attention}",
            f"mesh: {' x '.join(f'{a}={n}' for a, n in self.mesh.items())} on {self.devices} devices",
            self.batch.describe(),
            f"steps: {self.max_steps:,} x {self.batch.total_batch_size:,} tokens = {self.total_tokens:,} "
            f"tokens ({self.total_tokens / p['total']:.2f} tokens/param)",
            self.memory.describe(),
        ]
        if self.step_seconds:
            hours = self.step_seconds * self.max_steps / 3600
            spot, demand = self.hourly_usd
            lines.append(f"time: {self.step_seconds:.3f} s/step, {hours:.2f} h in all at the assumed MFU; "
                         f"cost ${hours * spot:,.2f} spot / ${hours * demand:,.2f} on demand")
        return "\n".join(lines)


MODES = ("train", "plan", "compile")


def resolve(cfg, devices: int) -> RunPlan:
    """Fill the config's derived (None) fields in place, check everything, return the run's plan.

    Precedence for the sequence length: model.sequence_len, else data.sequence_len, else the
    hardware profile's; for the per-device batch: trainer.device_batch_size, else the profile's
    tokens per device divided by the sequence length. ``devices`` counts every device of the run.
    """
    from xtrain.hardware import check_profile
    from xtrain.parallelism import batch_parallel, check_rules, mesh_shape

    model, data, hw, trainer = cfg.model, cfg.data, cfg.hardware, cfg.trainer
    if cfg.mode not in MODES:
        raise ConfigError(f"mode={cfg.mode!r}: expected one of {', '.join(MODES)}")
    check_profile(hw)
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
    if hw.engine == "xla":
        mesh = mesh_shape(cfg.parallelism, devices)
        specs = check_rules(cfg.parallelism.rules, mesh, param_shapes(shape))
    else:  # the cpu engine replicates (DDP over gloo across hosts)
        mesh, specs = {"data": devices, "fsdp": 1, "tensor": 1}, {}
    batch = batch_plan(trainer.device_batch_size, model.sequence_len, batch_parallel(mesh),
                       trainer.total_batch_size)
    params = param_counts(shape)
    steps = max_steps(trainer.max_steps, trainer.target_tokens_per_param, params["total"],
                      batch.total_batch_size)
    trainer.max_steps = steps
    memory = memory_per_chip(shape, specs, mesh, trainer.device_batch_size, model.attention,
                             hw.precision, hw.hbm_gib_per_chip)
    fpt = flops_per_token(shape)
    peak = hw.peak_bf16_tflops_per_chip * 1e12 * hw.chips
    step_s = fpt * batch.total_batch_size / (peak * hw.expected_mfu) if peak else 0.0
    plan = RunPlan(devices, mesh, params, fpt, batch, steps, model.attention, memory, step_s,
                   (hw.hourly_usd_spot, hw.hourly_usd_on_demand))
    return plan


def check_fits(plan: RunPlan) -> None:
    if not plan.memory.fits:
        raise ConfigError(f"does not fit: {plan.memory.describe()}. Lower trainer.device_batch_size "
                          "(gradient accumulation keeps the total batch), shard with "
                          "parallelism=fsdp, or use flash attention")
