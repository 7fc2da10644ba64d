"""Typed schemas for every config group, registered in Hydra's ConfigStore.

Each group under ``conf/`` validates against one dataclass here, so a misspelt key or a wrong type
fails at composition time with the field's full name (``optim.lrr``, ``trainer.max_steps``).
Fields are documented once, here. Values left as ``None`` are derived in :mod:`xtrain.plan` from
the rest of the config and printed before a run starts.

This module must stay cheap to import (no torch): ``--help``, ``--cfg job`` and ``mode=plan``
use it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, OmegaConf

from xtrain.paths import cache_root


class Mode(str, Enum):
    """What ``python -m xtrain`` does with the composed config (xtrain/modes.py)."""

    train = "train"  # train (the default)
    plan = "plan"  # print the derived numbers and checks, run nothing
    compile = "compile"  # the TPU preflight: compile the step for the profile's TPU (xtrain/preflight/)


class Attention(str, Enum):
    """Attention backends (xtrain/model/attention.py); ``auto`` is resolved by the planner."""

    auto = "auto"
    sdpa = "sdpa"  # torch's fused kernel
    chunked = "chunked"  # blockwise online softmax in torch ops, O(T x block) memory, any device
    flash = "flash"  # torch_xla's Pallas flash kernel (TPU); windowed layers run splash
    splash = "splash"  # torch_xla's Pallas splash kernel with a local mask (TPU)


# The device mesh's axes, in mesh order: the ``parallelism`` group sizes them, sharding rules and
# the attention kernels' partition specs name them. The batch dimension is split over BATCH_AXES.
DATA_AXIS, FSDP_AXIS, TENSOR_AXIS = "data", "fsdp", "tensor"
MESH_AXES = (DATA_AXIS, FSDP_AXIS, TENSOR_AXIS)
BATCH_AXES = (DATA_AXIS, FSDP_AXIS)


@dataclass
class HardwareConfig:
    """Facts about one machine or TPU slice; the only place such facts live."""

    name: str = MISSING
    engine: str = "cpu"  # cpu: plain PyTorch (Lightning CPU/DDP-gloo); xla: torch_xla SPMD
    accelerator_type: str | None = None  # gcloud --accelerator-type, e.g. v6e-4, v4-32
    runtime_version: str | None = None  # gcloud --version used to create the VM
    topology: str | None = None  # TPU compiler topology name, e.g. v6e:2x2
    chips: int = 1  # accelerator chips in the slice (v4 names count TensorCores: v4-32 = 16 chips)
    hosts: int = 1
    chips_per_host: int = 1
    cores_per_chip: int = 1  # TensorCores per chip
    hbm_gib_per_chip: float = 0.0  # 0 means "host memory, not checked"
    peak_bf16_tflops_per_chip: float = 0.0  # 0 means unknown: MFU is not reported
    hourly_usd_spot: float = 0.0  # whole slice, per hour
    hourly_usd_on_demand: float = 0.0
    expected_mfu: float = 0.3  # assumed by the planner for step time, wall time and cost
    precision: str = "float32"  # compute dtype of matmuls: float32 | bfloat16
    sequence_len: int = 256  # default model.sequence_len when neither data nor model sets it
    device_tokens: int = 2048  # default tokens per device per micro-batch (batch = this / seq)
    python: str = "3.11"
    pins: dict[str, str] = field(default_factory=dict)  # package -> exact version on the VM
    env: dict[str, str] = field(default_factory=dict)  # set before torch_xla initialises


@dataclass
class ModelConfig:
    """A nanochat-style GPT; ``depth`` is the one size dial (width = depth * aspect_ratio)."""

    depth: int = MISSING
    aspect_ratio: int = 64
    head_dim: int = 128
    n_kv_head: int | None = None  # None: equal to n_head (no GQA); must divide n_head
    vocab_size: int | None = None  # None: the data's tokenizer size
    sequence_len: int | None = None  # None: the data's, else the hardware profile's
    # Per-layer attention pattern, tiled over layers; the last layer is always full-context.
    # Letters (nanochat's): S = sliding window of `window_len`, L = full causal context.
    # Or G = global / L = local: a pattern containing G is read that way.
    window_pattern: str = "L"
    window_len: int | None = None  # None: sequence_len // 2
    attention: Attention = Attention.auto
    attention_block: int = 512  # block size of the chunked backend
    softcap: float = 15.0  # logits = softcap * tanh(logits / softcap)
    # XLA engine: run the transformer blocks as one compiled layer body looped over the stacked
    # weights (torch_xla's scan), so the compiled step holds one copy of a block instead of
    # `depth` copies: the TPU compile is several times faster and needs several times less host
    # RAM. Parameter names (checkpoint keys) are the same either way. None: on for TPU profiles,
    # off elsewhere (the CPU engine never scans; true there is refused).
    scan: bool | None = None
    # Activation checkpointing per layer: keep only each block's input for the backward pass and
    # recompute the block's activations there (about one extra forward). Cuts activation memory
    # to one block's worth plus depth x a residual stream; the planner counts it. None: on when
    # the blocks are scanned. (Unrolled, the TPU compiler rematerialises on its own to fit HBM;
    # it cannot across the scan loop, where everything the backward needs is kept: the v6e4 d16
    # 2048 x 8 step needs 37 GiB per chip scanned without remat, 18 GiB unrolled; BENCHMARKS.md.)
    remat: bool | None = None


@dataclass
class DataConfig:
    """Where tokens come from. Paths may be local or any fsspec URL (gs://...)."""

    name: str = MISSING
    train_files: str = MISSING  # directory or glob of parquet shards with a `text` column
    val_files: str | None = None  # None: no validation (unless holdout_last_shard)
    holdout_last_shard: bool = False  # nanochat's convention: the last train shard is validation
    tokenizer: str = MISSING  # directory: tokenizer.json (HF) or tokenizer.pkl (tiktoken)
    vocab_size: int = MISSING  # the tokenizer's size, known without reading it (for planning)
    sequence_len: int | None = None  # the sequence length this data implies, if any
    # Build-on-first-use (the embedded default): source trees and a cache dir. Empty: no build.
    build_sources: list[str] = field(default_factory=list)
    build_dir: str | None = None
    chunk_tokens: int = 2048  # token budget per chunk when building
    tokenizer_threads: int = 2
    prefetch: int = 4  # batches prepared ahead of the training step


@dataclass
class ParallelismConfig:
    """Mesh axes (MESH_AXES) over all devices; -1 means "the remaining devices"."""

    name: str = MISSING
    data: int = -1
    fsdp: int = 1
    tensor: int = 1
    # Parameter sharding rules: [regex searched in the parameter's name, partition spec], first
    # match wins; the spec has one entry per tensor dim: a mesh axis, a list of axes, or null.
    # Parameters no rule matches are replicated.
    rules: list[Any] = field(default_factory=list)


@dataclass
class OptimConfig:
    """Muon for transformer matrices, AdamW for embeddings and head (nanochat's recipe)."""

    matrix_lr: float = 0.02  # Muon
    embedding_lr: float = 0.2  # AdamW, token embedding
    unembedding_lr: float = 0.004  # AdamW, lm_head
    scale_adam_lr_by_width: bool = True  # nanochat: AdamW lrs scale as (width / 768) ** -0.5
    weight_decay: float = 0.0
    adam_beta1: float = 0.8
    adam_beta2: float = 0.95
    adam_eps: float = 1e-10
    muon_momentum: float = 0.95
    muon_ns_steps: int = 5  # Newton-Schulz iterations
    grad_clip: float = 1.0  # max global grad norm; 0 disables
    warmup_steps: int = 0
    warmdown_ratio: float = 0.2  # fraction of max_steps spent decaying linearly
    final_lr_frac: float = 0.0  # lr multiplier reached at the last step


@dataclass
class TrainerConfig:
    max_steps: int | None = 200  # None: from target_tokens_per_param
    target_tokens_per_param: float | None = None  # Chinchilla-style budget, e.g. 20
    device_batch_size: int | None = None  # sequences per device per micro-batch; None: derived
    total_batch_size: int | None = None  # tokens per optimizer step; None: no accumulation
    log_every: int = 10
    eval_every: int = 0  # 0: only at the end
    eval_batches: int = 8
    sample_tokens: int = 64  # length of the text sample printed at the end; 0 disables
    seed: int = 42
    # CPU engine: torch.compile the model's forward+backward and the optimizer update (inductor;
    # compiled code cached under <cache root>/inductor). None: on where it pays (models from
    # width 256 and 512 tokens per sequence; xtrain/engines/cpu.py). The XLA engine always
    # compiles the whole step.
    compile: bool | None = None


@dataclass
class CheckpointConfig:
    dir: str | None = None  # None: <run dir>/checkpoints; may be gs://bucket/prefix
    every: int = 0  # steps between checkpoints; 0: only the final one (and on preemption)
    keep_last: int = 2  # newest committed checkpoints kept
    keep_every: int = 0  # also keep every checkpoint whose step is a multiple of this; 0: none
    resume: str | None = None  # explicit checkpoint dir to start from; None: newest in `dir`
    retries: int = 5  # upload attempts after a storage error (backoff 1, 2, 4, ... s); then warn


@dataclass
class CompileCacheConfig:
    """torch_xla's persistent compilation cache (xtrain/xla/compile_cache.py): a relaunched or
    resumed run loads its compiled step instead of compiling it again."""

    enabled: bool | None = None  # None: on for TPU profiles, off for XLA on CPU
    # None: <cache root>/xla_compile. A gs:// URL is mirrored: pulled into the local cache before
    # the first compile, new entries pushed after the first step and at the end of the run.
    dir: str | None = None


@dataclass
class PreflightConfig:
    """``mode=compile`` (xtrain/preflight/)."""

    # Refuse to start a TPU compile whose expected host RAM (from earlier compiles' reports)
    # exceeds this machine's available memory (RAM + swap); false: try anyway.
    check_host_ram: bool = True


@dataclass
class LoggingConfig:
    wandb: bool = False  # the key comes from WANDB_API_KEY in the environment, never from config
    wandb_project: str = "xtrain"
    wandb_entity: str | None = None


@dataclass
class RunConfig:
    name: str = MISSING  # default derived from the chosen groups and overrides


@dataclass
class TrainConfig:
    mode: Mode = Mode.train
    run: RunConfig = field(default_factory=RunConfig)
    hardware: HardwareConfig = MISSING
    model: ModelConfig = MISSING
    data: DataConfig = MISSING
    parallelism: ParallelismConfig = MISSING
    optim: OptimConfig = MISSING
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    compile_cache: CompileCacheConfig = field(default_factory=CompileCacheConfig)
    preflight: PreflightConfig = field(default_factory=PreflightConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)


# Overrides that do not change what is trained, so they keep the run's name (and its checkpoints).
_NAME_NEUTRAL_PREFIXES = ("trainer.max_steps", "trainer.log_every", "trainer.eval", "trainer.sample",
                          "mode", "run.", "checkpoint.", "logging.", "hydra.", "data.prefetch",
                          "data.tokenizer_threads", "compile_cache.", "preflight.", "model.scan",
                          "model.remat")


def run_name() -> str:
    """``<model>-<hardware>-<data>`` plus the identity-changing overrides, e.g. ``d16-v6e4-cpp16k``.

    Deterministic (no timestamp), so re-running a command lands in the same directory and resumes.
    Sweep jobs differ in their overrides and therefore get distinct names.
    """
    from hydra.core.hydra_config import HydraConfig

    hc = HydraConfig.get()
    choices = hc.runtime.choices
    parts = [choices.get("model"), choices.get("hardware"), choices.get("data")]
    groups = {"model", "hardware", "data"}
    extra = []
    for override in hc.overrides.task:
        key = override.split("=", 1)[0].lstrip("+~")
        if key in groups or key.startswith(_NAME_NEUTRAL_PREFIXES):
            continue
        extra.append(override.replace("/", "_").replace("=", "_"))
    return "-".join(str(p) for p in parts + sorted(extra) if p)


def register() -> None:
    """Register the schemas and resolvers (idempotent)."""
    ConfigStore.instance().store(name="train_schema", node=TrainConfig)
    if not OmegaConf.has_resolver("xtrain_run_name"):
        OmegaConf.register_new_resolver("xtrain_run_name", run_name)
    if not OmegaConf.has_resolver("xtrain_cache"):  # ${xtrain_cache:}: see xtrain.paths.cache_root
        OmegaConf.register_new_resolver("xtrain_cache", lambda: str(cache_root()))


def to_plain(cfg) -> dict:
    """A config as plain JSON-ready containers (enums as their names), resolved."""
    return OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
