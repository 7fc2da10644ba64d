"""Derived numbers: parameters, FLOPs, batch arithmetic, memory, time and cost. Everything a run
derives is computed here, once, printed, and checked; bad values are refused with the arithmetic
shown (:class:`xtrain.errors.ConfigError`). :func:`resolve` fills the config's derived fields in
place and returns the :class:`RunPlan`; the functions it calls are pure.

FLOPs convention (used for MFU): a training token costs 6 FLOPs per matmul parameter (2 forward,
4 backward; the embedding lookup is not a matmul, the lm_head is) plus attention's two matmuls,
QK^T and PV, 2 * 2 * head_dim FLOPs per head per *attended key*, times 3 for forward+backward.
Attended keys are counted honestly: a causal query at position i sees i + 1 keys, a windowed one
min(i, W) + 1, averaged over the sequence. (nanochat's estimate counts all T keys for every
query, which doubles attention FLOPs and inflates MFU at long context.)
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

from xtrain.config import TENSOR_AXIS, Attention, Engine, Mode, TrainConfig
from xtrain.limits import out_of_range
from xtrain.errors import ConfigError
from xtrain.model.config import GPTConfig
from xtrain.parallelism import batch_parallel, check_rules, mesh_shape, per_host_batch
from xtrain.units import GIB


def mean_attended_keys(T: int, window: int | None) -> float:
    """Average keys a query attends to over positions 0..T-1 (causal, optionally windowed)."""
    if window is None or window >= T - 1:
        return (T + 1) / 2
    # positions 0..W see i + 1 keys; the rest see W + 1
    head = (window + 1) * (window + 2) / 2
    return (head + (T - window - 1) * (window + 1)) / T


def flops_per_token(gpt: GPTConfig) -> float:
    """Training FLOPs per token (forward + backward), with the convention in the module docstring."""
    counts = gpt.param_counts()
    matmul_params = counts["total"] - counts["embedding"]
    attn = sum(12 * gpt.n_head * gpt.head_dim * mean_attended_keys(gpt.sequence_len, w)
               for w in gpt.windows)
    return 6 * matmul_params + attn


def choose_attention(requested: str, engine: str, on_tpu: bool, seq_len: int) -> str:
    """``auto``: on TPU, Pallas flash attention from 2K context. XLA's SDPA ran as fast as flash
    below 4K on v6e, but SDPA materialises [B, H, T, T] scores: the TPU compiler puts the d16
    step at 2048 x 8 on v6e at >= 35.9 GiB per chip with SDPA (it does not fit), while the same
    step with flash/splash needs about 20 GiB (BENCHMARKS.md). SDPA below 2K. Elsewhere the
    chunked kernel for long context (memory), torch SDPA otherwise."""
    requested = Attention(requested)  # the schema already refused other names
    if requested != Attention.auto:
        if requested in (Attention.flash, Attention.splash) and not on_tpu:
            raise ConfigError(f"model.attention={requested.value}: the Pallas kernels need a TPU "
                              f"(hardware.engine={getattr(engine, 'value', engine)}); use sdpa or chunked")
        return requested.value
    if on_tpu:
        return (Attention.flash if seq_len >= 2048 else Attention.sdpa).value
    return (Attention.chunked if seq_len >= 8192 else Attention.sdpa).value


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


def memory_per_chip(gpt: GPTConfig, specs: dict, mesh: dict, device_batch: int, precision: str,
                    hbm_gib: float) -> MemoryPlan:
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
      the softcap fuses into them). The CPU engine's fused loss holds neither (xtrain/model/loss.py),
      so there the figure is an upper bound; it has no HBM to check against.
    - with activation checkpointing (``remat``), only each block's input is saved, the float32
      residual stream, 4 B * d per token per layer; one block's activations (the per-layer
      figure above) are alive at a time, while that block's backward recomputes them.
    Not counted: XLA's temporaries, fragmentation, and its rematerialisation (which can lower the
    real peak). Compiling for the target (mode=compile) gives the compiler's own figure;
    BENCHMARKS.md compares the two.
    """
    from xtrain.parallelism import shard_ways

    tp = mesh.get(TENSOR_AXIS, 1)
    weights = optimizer = 0.0
    for name, dims in gpt.param_shapes().items():
        numel = math.prod(dims) / shard_ways(specs.get(name), mesh)
        weights += 4 * numel
        optimizer += (8 if name in ("wte.weight", "lm_head.weight") else 4) * numel
    d, T, H = gpt.n_embd, gpt.sequence_len, gpt.n_head
    a = 2 if precision == "bfloat16" else 4
    per_layer = a * (4 * d + (10 * d + 2 * gpt.kv_dim) / tp)
    if gpt.attention == Attention.sdpa:
        per_layer += a * H * T / tp
    elif gpt.attention == Attention.chunked:
        per_layer += a * H * min(gpt.attention_block, T) / tp
    logits = 8 * gpt.vocab_size / tp
    if gpt.remat:
        per_token = gpt.n_layer * 4 * d + per_layer + logits
    else:
        per_token = gpt.n_layer * per_layer + logits
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
    if explicit is not None:  # (>= 1: the schema's limit)
        return explicit
    if tokens_per_param is None:
        raise ConfigError("set trainer.max_steps or trainer.target_tokens_per_param")
    return max(1, math.ceil(tokens_per_param * params / total_batch))


@dataclass
class RunPlan:
    """What a run derives from its config; printed before training and checked."""

    devices: int  # all devices of the run (chips, virtual CPU devices, or CPU processes)
    hosts: int  # processes, one per host (a TPU slice's workers, or the CPU engine's processes)
    engine: str  # hardware.engine
    mesh: dict
    gpt: GPTConfig  # the model's shape, attention backend resolved
    flops_per_token: float
    batch: BatchPlan
    max_steps: int
    memory: MemoryPlan
    step_seconds: float  # at the profile's expected MFU; 0 when the peak is unknown
    hourly_usd: tuple[float, float]  # (spot, on demand) for the whole slice
    unused_target: float | None = None  # target_tokens_per_param, when max_steps is given too

    @property
    def params(self) -> dict[str, int]:
        return self.gpt.param_counts()

    @property
    def attention(self) -> str:
        return self.gpt.attention

    @property
    def total_tokens(self) -> int:
        return self.max_steps * self.batch.total_batch_size

    def describe(self) -> str:
        p, g = self.params, self.gpt
        lines = [
            f"model: {g.n_layer} layers, width {g.n_embd}, {g.n_head} heads of {g.head_dim} "
            f"({g.n_kv_head} for keys and values), vocab {g.vocab_size:,}, context {g.sequence_len:,}",
            f"parameters: {p['total']:,} (embedding {p['embedding']:,}, lm_head {p['lm_head']:,}, "
            f"attention {p['attention']:,}, mlp {p['mlp']:,})",
            f"FLOPs/token (train): {self.flops_per_token:.4g}   attention backend: {self.attention}",
            f"mesh: {' x '.join(f'{a}={n}' for a, n in self.mesh.items())} on {self.devices} devices",
            self.batch.describe(),
            f"steps: {self.max_steps:,} x {self.batch.total_batch_size:,} tokens = {self.total_tokens:,} "
            f"tokens ({self.total_tokens / p['total']:.2f} tokens/param)" + (f"; trainer.max_steps sets the "
            f"length, not trainer.target_tokens_per_param={self.unused_target:g}" if self.unused_target else ""),
            self.memory.describe(),
        ]
        if self.hosts > 1:
            lines.append(self.describe_hosts())
        if self.step_seconds:
            hours = self.step_seconds * self.max_steps / 3600
            spot, demand = self.hourly_usd
            lines.append(f"time: {self.step_seconds:.3f} s/step, {hours:.2f} h in all at the assumed MFU; "
                         f"cost ${hours * spot:,.2f} spot / ${hours * demand:,.2f} on demand")
        return "\n".join(lines)

    def describe_hosts(self) -> str:
        """What each of several hosts (processes) loads and writes."""
        rows = self.batch.device_batch_size * self.batch.data_parallel
        share, who = rows // self.hosts, "process" if self.engine == "cpu" else "host"
        lines = [f"{who}{'es' if who == 'process' else 's'}: {self.hosts}, one process each ({self.devices // self.hosts} "
                 f"device{'s' if self.devices // self.hosts > 1 else ''} per {who}); {who} h:"]
        if self.engine == "cpu":
            lines.append(f"  loads: rows {share}h..{share}h+{share - 1} of each micro-batch's {rows} "
                         "(every process packs the same global batch and keeps its own rows); "
                         "trains a full replica, gradients averaged over gloo (DDP)")
            lines.append("  writes: a share of each checkpoint's tensors (DCP spreads the replicated "
                         "tensors over the processes)")
            lines.append("  reads on resume: every tensor (each process holds a full replica)")
        else:
            if per_host_batch(self.mesh):
                lines.append(f"  loads: rows {share}h..{share}h+{share - 1} of each micro-batch's "
                             f"{rows} (every host packs the same global batch and keeps its own "
                             "rows; torch_xla's per-host input sharding assembles the global array)")
            else:
                lines.append(f"  loads: all {rows} rows of each micro-batch (the batch is replicated "
                             "over the tensor axis, which per-host input sharding cannot express) "
                             "and uploads only the rows its devices hold")
            lines.append("  writes: its own shards of each checkpoint (DCP, torch_xla's SPMD planner)")
            lines.append("  reads on resume: the checkpoint's metadata and only the files holding "
                         "its shards")
        lines.append(f"  {who} 0 alone also writes metrics.jsonl, logs, samples and the checkpoint's "
                     "state.pt, meta.json and COMMITTED")
        return "\n".join(lines)


def check_ranges(cfg) -> None:
    """Refuse every value outside the range its schema field declares (all modes)."""
    problems = out_of_range(cfg, TrainConfig)
    if problems:
        raise ConfigError("; ".join(problems))


def resolve(cfg, devices: int) -> RunPlan:
    """Fill the config's derived (None) fields in place, check everything, return the run's plan.

    Precedence for the sequence length: model.sequence_len, else data.sequence_len, else the
    hardware profile's; for the per-device batch: trainer.device_batch_size, else the profile's
    tokens per device divided by the sequence length. ``devices`` counts every device of the run.
    """
    from xtrain.hardware import check_profile

    model, data, hw, trainer = cfg.model, cfg.data, cfg.hardware, cfg.trainer
    check_ranges(cfg)
    check_profile(hw)
    check_engine_can_honour(cfg.parallelism, hw, cfg.mode)
    check_validation_split(data)
    if model.vocab_size is None:
        model.vocab_size = data.vocab_size
    elif model.vocab_size != data.vocab_size:
        raise ConfigError(f"model.vocab_size={model.vocab_size} disagrees with the tokenizer of "
                          f"data={data.name} (data.vocab_size={data.vocab_size})")
    if model.sequence_len is None:
        model.sequence_len = data.sequence_len or hw.sequence_len
    on_tpu = hw.engine == "xla" and bool(hw.accelerator_type)
    model.attention = choose_attention(model.attention, hw.engine, on_tpu, model.sequence_len)
    # unrolled by default: it fits without remat, which scanned steps bring (an extra forward per
    # step); scanned ones compile faster (BENCHMARKS.md, "TPU compile")
    if model.scan is None:
        model.scan = False
    if model.remat is None:
        model.remat = bool(model.scan)
    if model.scan and hw.engine != "xla":
        raise ConfigError("model.scan=true needs the XLA engine (hardware.engine=xla): the CPU "
                          "engine runs the blocks in a loop")
    gpt = GPTConfig.from_model(model)
    if on_tpu:
        gpt.check_tpu_kernel_shapes()
    if trainer.device_batch_size is None:
        trainer.device_batch_size = default_device_batch(hw.device_tokens, model.sequence_len)
    mesh = mesh_shape(cfg.parallelism, devices)
    specs = check_rules(cfg.parallelism.rules, mesh, gpt.param_shapes())
    batch = batch_plan(trainer.device_batch_size, model.sequence_len, batch_parallel(mesh),
                       trainer.total_batch_size)
    target, args = trainer.target_tokens_per_param, (gpt.param_counts()["total"], batch.total_batch_size)
    trainer.max_steps = steps = max_steps(trainer.max_steps, target, *args)
    unused_target = target if target and max_steps(None, target, *args) != steps else None
    memory = memory_per_chip(gpt, specs, mesh, trainer.device_batch_size, hw.precision,
                             hw.hbm_gib_per_chip)
    fpt = flops_per_token(gpt)
    peak = hw.peak_bf16_tflops_per_chip * 1e12 * hw.chips
    step_s = fpt * batch.total_batch_size / (peak * hw.expected_mfu) if peak else 0.0
    # one process per host: the CPU engine's devices are its processes; XLA on CPU is one process
    hosts = devices if hw.engine == "cpu" else (hw.hosts if hw.accelerator_type else 1)
    return RunPlan(devices, hosts, hw.engine, mesh, gpt, fpt, batch, steps, memory, step_s,
                   (hw.hourly_usd_spot, hw.hourly_usd_on_demand), unused_target)


def check_engine_can_honour(par, hw, mode: Mode = Mode.train) -> None:
    """Settings the cpu engine would ignore while they still name the run: it replicates every
    parameter (fsdp and tensor axes, and sharding rules, need the xla engine), it starts no
    XLA runtime to give ``hardware.env`` to (a TPU profile's own env is left alone), and it
    trains on the host's CPU, not on a TPU profile's chips (sampling or scoring a checkpoint
    there is fine)."""
    if hw.engine != Engine.cpu:
        return
    if hw.accelerator_type and mode not in (Mode.sample, Mode.eval):
        raise ConfigError(f"hardware.engine=cpu with hardware={hw.name}: the cpu engine would run "
                          f"on the host's CPU and leave the {hw.accelerator_type} TPU unused (and "
                          "the plan would count its chips); TPU profiles train with "
                          "hardware.engine=xla, the cpu profiles (hardware=cpu) on the CPU")
    sharding = [f"parallelism.{k}={v}" for k, v in (("fsdp", par.fsdp), ("tensor", par.tensor))
                if v != 1] + ([f"{len(par.rules)} parallelism.rules"] if par.rules else [])
    if sharding:
        raise ConfigError(f"parallelism={par.name} with {', '.join(sharding)} shards parameters: the cpu "
                          "engine replicates every parameter; use parallelism=dp as it is, or hardware.engine=xla")
    if hw.env and not hw.accelerator_type:
        raise ConfigError(f"hardware.env sets {', '.join(sorted(hw.env))}: the XLA runtime's "
                          "environment, which the cpu engine does not start; set such variables "
                          "in the shell (VAR=value python -m xtrain ...), or use hardware.engine=xla")


def check_validation_split(data) -> None:
    """One validation split: the held-out last train shard, or ``val_files``, not both (the
    holdout would win and val_files be read by nothing)."""
    if data.holdout_last_shard and data.val_files:
        raise ConfigError(f"data.val_files={data.val_files} with data.holdout_last_shard=true: "
                          "validation would read the last train shard, not val_files; set "
                          "data.holdout_last_shard=false to validate on val_files (or "
                          "data.val_files=null)")


def memory_levers(cfg, plan: RunPlan) -> list[tuple[str, float]]:
    """(override, GiB per chip with it) for each change that would lower this run's memory, as
    the planner estimates it: a smaller device batch (gradient accumulation keeps the total),
    FSDP sharding, flash attention on TPU, per-layer activation checkpointing."""
    from omegaconf import OmegaConf

    from xtrain.paths import config_dir

    levers: dict[str, dict] = {}
    batch = plan.batch.device_batch_size
    if batch > 1:
        levers[f"trainer.device_batch_size={batch // 2}"] = {"trainer": {"device_batch_size": batch // 2}}
        levers["trainer.device_batch_size=1"] = {"trainer": {"device_batch_size": 1}}
    if plan.mesh.get("fsdp", 1) == 1 and plan.devices > 1 and cfg.hardware.engine == Engine.xla:
        fsdp = OmegaConf.load(os.path.join(config_dir(), "parallelism", "fsdp.yaml"))
        levers["parallelism=fsdp"] = {"parallelism": fsdp}
    if plan.attention == Attention.sdpa and cfg.hardware.accelerator_type:
        levers["model.attention=flash"] = {"model": {"attention": "flash"}}
    if "remat" in cfg.model and not cfg.model.remat:
        levers["model.remat=true"] = {"model": {"remat": True}}
    found = []
    for override, delta in levers.items():
        trial = OmegaConf.merge(cfg, delta)
        try:
            memory = resolve(trial, plan.devices).memory
        except ConfigError:
            continue  # the lever does not apply here (e.g. a batch that no longer divides)
        if memory.total < plan.memory.total:
            found.append((override, memory.total / GIB))
    return found


def describe_levers(cfg, plan: RunPlan) -> str:
    """The levers of :func:`memory_levers` with their estimates ("" when none applies)."""
    hbm = plan.memory.hbm / GIB
    return "; ".join(f"{o} -> {gib:.2f} GiB{'' if gib <= hbm else ' (still too much)'}"
                     for o, gib in memory_levers(cfg, plan))


def check_fits(plan: RunPlan, cfg=None) -> None:
    if plan.memory.fits:
        return
    helps = describe_levers(cfg, plan) if cfg is not None else ""
    advice = f"levers, estimated: {helps}" if helps else (
        "no setting of this profile lowers it: a larger slice (more chips) or a smaller model")
    raise ConfigError(f"does not fit: {plan.memory.describe()}; {advice}")
