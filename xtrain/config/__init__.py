"""Typed schemas for every config group, registered in Hydra's ConfigStore.

Each group under ``conf/`` validates against one dataclass here, so a misspelt key, a wrong type
or an unknown choice fails at composition time with the field's full name (``optim.lrr``,
``trainer.max_steps``). Fields are documented once, here, with their allowed range
(:func:`limits`; :func:`out_of_range` checks them before anything else runs). Values left as
``None`` are derived in :mod:`xtrain.plan` from the rest of the config and printed before a run
starts.

This module must stay cheap to import (no torch): ``--help``, ``--cfg job`` and ``mode=plan``
use it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from hydra._internal.core_plugins.basic_sweeper import BasicSweeperConf
from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, OmegaConf

from xtrain.config.evaluation import EvalConfig, Sandbox  # noqa: F401
from xtrain.config.hydra_record import PENDING, RECORD
from xtrain.config.outputs import (JsonlLoggerConfig, LoggerConfig, SampleConfig,  # noqa: F401
                                   TensorBoardLoggerConfig, WandbLoggerConfig, WandbMode,
                                   sample_prompts)
from xtrain.limits import limits
from xtrain.paths import cache_root


class Mode(str, Enum):
    """What ``python -m xtrain`` does with the composed config (xtrain/modes.py)."""

    train = "train"  # train (the default)
    plan = "plan"  # print the derived numbers and checks, run nothing
    compile = "compile"  # the TPU preflight: compile the step for the profile's TPU (xtrain/preflight/)
    sample = "sample"  # generate text from a checkpoint (checkpoint.resume, else the run's newest)
    eval = "eval"  # score a checkpoint (chosen as for sample) on the C++ benchmark (the eval group)

    @property
    def keeps_nothing(self) -> bool:
        """Run here (not launched), the mode's run dir goes at its end (xtrain/cli.py)."""
        return self in (Mode.plan, Mode.compile)


class Engine(str, Enum):
    """How a step runs (xtrain/engines/)."""

    cpu = "cpu"  # plain PyTorch through Lightning's Trainer
    xla = "xla"  # torch_xla SPMD (TPU, or CPU PJRT with CPU_NUM_DEVICES virtual devices)


class Precision(str, Enum):
    """Compute dtype of the matmuls; weights and optimizer state stay float32."""

    float32 = "float32"
    bfloat16 = "bfloat16"


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
    engine: Engine = MISSING
    accelerator_type: str | None = None  # gcloud --accelerator-type, e.g. v6e-4, v4-32
    runtime_version: str | None = None  # gcloud --version used to create the VM
    topology: str | None = None  # TPU compiler topology name, e.g. v6e:2x2
    # accelerator chips in the slice (v4 names count TensorCores: v4-32 = 16 chips)
    chips: int = limits(ge=1)
    # machines, one training process each: TPU VM workers (xla), or CPU processes joined over
    # gloo (cpu); a cpu profile with hosts > 1 needs the standard launch variables (README)
    hosts: int = limits(ge=1)
    chips_per_host: int = limits(ge=1)
    cores_per_chip: int = limits(1, ge=1)  # TensorCores per chip
    hbm_gib_per_chip: float = limits(0.0, ge=0)  # 0 means "host memory, not checked"
    peak_bf16_tflops_per_chip: float = limits(0.0, ge=0)  # 0 means unknown: MFU is not reported
    hourly_usd_spot: float = limits(0.0, ge=0)  # whole slice, per hour
    hourly_usd_on_demand: float = limits(0.0, ge=0)
    # assumed by the planner for step time, wall time and cost
    expected_mfu: float = limits(0.3, gt=0, le=1)
    precision: Precision = MISSING
    # default model.sequence_len when neither data nor model sets it
    sequence_len: int = limits(ge=1)
    # default tokens per device per micro-batch (device batch = this / sequence length)
    device_tokens: int = limits(ge=1)
    python: str = "3.11"  # the Python version the launchers make the worker's venv with
    pins: dict[str, str] = field(default_factory=dict)  # package -> exact version on the VM
    # environment of the XLA runtime and the TPU compiler, set before torch_xla initialises (a
    # variable already set wins); the cpu engine reads none of it (refused on the cpu profile)
    env: dict[str, str] = field(default_factory=dict)


@dataclass
class ModelConfig:
    """A nanochat-style GPT; ``depth`` is the one size dial (width = depth * aspect_ratio)."""

    depth: int = limits(MISSING, ge=1)
    aspect_ratio: int = limits(64, ge=1)
    head_dim: int = limits(128, ge=2)  # n_head = width / head_dim (even: rotary pairs)
    # None: equal to n_head (no GQA); must divide n_head
    n_kv_head: int | None = limits(None, ge=1)
    vocab_size: int | None = limits(None, ge=1)  # None: the data's tokenizer size
    sequence_len: int | None = limits(None, ge=1)  # None: the data's, else the hardware profile's
    # Per-layer attention pattern, tiled over layers; the last layer is always full-context.
    # Letters (nanochat's): S = sliding window of `window_len`, L = full causal context.
    # Or G = global / L = local: a pattern containing G is read that way.
    window_pattern: str = "L"
    window_len: int | None = limits(None, ge=1)  # None: sequence_len // 2 (at least 1)
    attention: Attention = Attention.auto
    attention_block: int = limits(512, ge=1)  # block size of the chunked backend
    softcap: float = limits(15.0, gt=0)  # logits = softcap * tanh(logits / softcap)
    # XLA engine: run the transformer blocks as one compiled layer body looped over the stacked
    # weights (torch_xla's scan), so the compiled step holds one copy of a block instead of
    # `depth` copies (a smaller program, a faster TPU compile). Parameter names (checkpoint keys)
    # are the same either way; the micro-batches of a step are fenced either way
    # (xtrain/engines/step.py). None: off (BENCHMARKS.md, "TPU compile"; the CPU engine never
    # scans, true there is refused).
    scan: bool | None = None
    # Activation checkpointing per layer: keep only each block's input for the backward pass and
    # recompute the block's activations there (about one extra forward). Cuts activation memory
    # to one block's worth plus depth x a residual stream; the planner counts it. None: on when
    # the blocks are scanned. (Unrolled, the TPU compiler rematerialises on its own to fit HBM;
    # it cannot across the scan loop, where everything the backward needs is kept: the v6e4 d16
    # 2048 x 8 step needs 26.2 GiB per chip scanned without remat, 20.9 unrolled, and v5e8's
    # 1024 x 8 does not fit scanned without it; BENCHMARKS.md.)
    remat: bool | None = None


@dataclass
class DataConfig:
    """Where tokens come from. Paths may be local or any fsspec URL (gs://...)."""

    name: str = MISSING
    train_files: str = MISSING  # parquet shards with a `text` column: a directory, a glob or one file
    val_files: str | None = None  # None: no validation (unless holdout_last_shard)
    # nanochat's convention: the last train shard is validation (val_files must then be None)
    holdout_last_shard: bool = False
    tokenizer: str = MISSING  # directory: tokenizer.json (HF) or tokenizer.pkl (tiktoken)
    # the tokenizer's size, known without reading it (for planning)
    # (at least 256 byte tokens and <|bos|>: xtrain/data/tokenizer.py's byte-level BPE)
    vocab_size: int = limits(MISSING, ge=257, hint="a byte-level BPE's 256 bytes and <|bos|>")
    sequence_len: int | None = limits(None, ge=1)  # the sequence length this data implies, if any
    # Build-on-first-use (the embedded default): source trees and the directory the corpus and
    # tokenizer are built into (${xtrain_corpus:...} keys it by what it is built from). Empty
    # sources: nothing is built.
    build_sources: list[str] = field(default_factory=list)
    build_dir: str | None = None
    chunk_tokens: int = limits(2048, ge=1)  # token budget per chunk when building
    tokenizer_threads: int = limits(2, ge=1)  # threads encoding text for each loader
    prefetch: int = limits(4, ge=1)  # batches prepared ahead of the training step
    # seconds a remote (gs://) data or checkpoint location may take to answer the first listing
    remote_timeout_s: float = limits(20.0, gt=0)


@dataclass
class ParallelismConfig:
    """Mesh axes (MESH_AXES) over all devices; -1 means "the remaining devices". The cpu engine
    replicates every parameter: only the data axis applies to it."""

    name: str = MISSING
    data: int = MISSING
    fsdp: int = MISSING
    tensor: int = MISSING
    # Parameter sharding rules: [regex searched in the parameter's name, partition spec], first
    # match wins; the spec has one entry per tensor dim: a mesh axis, a list of axes, or null.
    # Parameters no rule matches are replicated.
    rules: list[Any] = MISSING


@dataclass
class OptimConfig:
    """Muon for transformer matrices, AdamW for embeddings and head (nanochat's recipe)."""

    matrix_lr: float = limits(0.02, ge=0)  # Muon
    embedding_lr: float = limits(0.2, ge=0)  # AdamW, token embedding
    unembedding_lr: float = limits(0.004, ge=0)  # AdamW, lm_head
    scale_adam_lr_by_width: bool = True  # nanochat: AdamW lrs scale as (width / 768) ** -0.5
    weight_decay: float = limits(0.0, ge=0)  # Muon's matrices only (AdamW's groups take none)
    adam_beta1: float = limits(0.8, ge=0, lt=1)
    adam_beta2: float = limits(0.95, ge=0, lt=1)
    adam_eps: float = limits(1e-10, gt=0)
    muon_momentum: float = limits(0.95, ge=0, lt=1)
    muon_ns_steps: int = limits(5, ge=1)  # Newton-Schulz iterations
    grad_clip: float = limits(1.0, ge=0)  # max global grad norm; 0 disables
    warmup_steps: int = limits(0, ge=0)  # steps the lr ramps up linearly to each group's lr
    warmdown_ratio: float = limits(0.2, ge=0, le=1)  # fraction of max_steps decaying linearly
    final_lr_frac: float = limits(0.0, ge=0, le=1)  # lr multiplier reached at the last step


@dataclass
class TrainerConfig:
    """How long and how a run trains. TPU profiles bring conf/trainer/tpu.yaml: 524,288 tokens
    per step and a token budget of 20 tokens per parameter (Chinchilla's ratio, nanochat's
    default), so the number of steps follows from the model's size."""

    max_steps: int | None = limits(200, ge=1)  # None: from target_tokens_per_param
    # tokens per parameter the run trains on, when max_steps is None
    target_tokens_per_param: float | None = limits(None, gt=0)
    # sequences per device per micro-batch; None: the hardware profile's device_tokens / seq
    device_batch_size: int | None = limits(None, ge=1)
    # tokens per optimizer step (gradient accumulation makes up the rest); None: no accumulation
    total_batch_size: int | None = limits(None, ge=1)
    # steps between metrics records (the step's loss and norms leave the device only then)
    log_every: int = limits(10, ge=1)
    eval_every: int = limits(0, ge=0)  # steps between validations, and one at the end; 0: the end only
    # validation tokens per evaluation, in whole sequences (rounded up; at most one pass): the same
    # rows whatever the batch size and the process count, so runs on other hardware compare
    eval_tokens: int = limits(16384, ge=1)
    # tokens per training sample (every sample_every steps, and at the end); 0: none
    sample_tokens: int = limits(64, ge=0)
    # steps between samples during training (prompts: sample.*); 0: at the end only
    sample_every: int = limits(0, ge=0)
    # initial weights and the data order (samples: sample.seed); Lightning's seed_everything
    # takes 32 bits
    seed: int = limits(42, ge=0, le=2**32 - 1)
    # XLA engine: stop the run when its training step has compiled more graphs than this (a
    # healthy run compiles the step once), naming the graph and torch_xla's reason; None: no
    # limit. The debug presets set 1.
    max_compiles: int | None = limits(None, ge=1)
    # > 0: train on the first N optimizer steps' batches over and over (debug: overfit a batch)
    overfit_batches: int = limits(0, ge=0)
    # write a PyTorch profiler trace (chrome format) of a few steps after warm-up into the run dir
    profile: bool = False
    # Seconds one process waits for the others in a collective (gloo: gradients, barriers, stop
    # votes, checkpoint saves) before failing. Must exceed the longest legitimate wait, e.g. the
    # slowest host's checkpoint upload. A process that vanishes (SIGKILL) is named as soon as the
    # others notice, usually at their next collective.
    collective_timeout_s: float = limits(600.0, gt=0)
    # CPU engine: torch.compile the model's forward+backward and the optimizer update (inductor;
    # compiled code cached under <cache root>/inductor). None: on where it pays (models from
    # width 256 and 512 tokens per sequence; compile_pays in xtrain/engines/torch_compile.py).
    # The XLA engine always compiles the whole step.
    compile: bool | None = None


@dataclass
class CheckpointConfig:
    """Where and how often training state is saved (xtrain/checkpoint/): atomic commits, resumed
    by running the same command again."""

    dir: str | None = None  # None: <run dir>/checkpoints; may be gs://bucket/prefix
    every: int = limits(0, ge=0)  # steps between checkpoints; 0: only the final one (and on stop)
    # newest committed checkpoints kept (the newest is never deleted)
    keep_last: int = limits(2, ge=1, hint="to keep every checkpoint, set checkpoint.keep_every=1")
    # also keep every checkpoint whose step is a multiple of this; 0: none; 1: all
    keep_every: int = limits(0, ge=0)
    resume: str | None = None  # explicit checkpoint dir to start from; None: newest in `dir`
    # resume from an older step than `dir` holds: its newer commits are renamed aside (kept), not
    # refused (the default: training on would replace them as it reached their steps)
    rewind: bool = False
    # upload attempts after a storage error (backoff 1, 2, 4, ... s); then warn
    retries: int = limits(5, ge=0)
    # seconds a training's lease on `dir` outlives its last renewal (every quarter of it): another
    # training finding it held is refused, or takes it over once its holder is gone
    # (xtrain/checkpoint/lease.py); 0: no lease
    lease_s: int = limits(120, ge=0)


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
class PreemptionConfig:
    """How a run learns that it must stop (SIGTERM, Ctrl-C, or a GCE notice), stopping at a step
    boundary with a checkpoint (xtrain/train/preemption.py, xtrain/train/notices.py)."""

    # GCE metadata server to watch for preemption and maintenance notices. None: the real one
    # (http://metadata.google.internal/computeMetadata/v1) when running on a GCE VM, nothing
    # elsewhere (no thread, no request).
    metadata_url: str | None = None
    watch_notices: bool = True  # false: rely on SIGTERM alone, even on GCE
    # Host maintenance (instance/upcoming-maintenance): stop when the maintenance is ONGOING, or
    # when its window starts within this many seconds (checked every 30 s, so the stop comes
    # between this and 30 s less ahead of the window). Time for the stop and its checkpoint to
    # finish before the VM may be taken down; 0: only a window that has started. The fleet
    # launcher watches the VM this much longer after a notice's stop (xtrain/launcher/fleet.py).
    maintenance_lead_s: float = limits(300.0, ge=0)


@dataclass
class RunConfig:
    """The run's identity: its directory (outputs/<name>) and its checkpoints' owner."""

    name: str = MISSING  # default from the chosen groups, config and overrides (xtrain/naming.py)


@dataclass
class TrainConfig:
    """The whole composed config (conf/train.yaml): one field per group or section."""

    mode: Mode = Mode.train
    run: RunConfig = field(default_factory=RunConfig)
    hardware: HardwareConfig = MISSING
    model: ModelConfig = MISSING
    data: DataConfig = MISSING
    parallelism: ParallelismConfig = MISSING
    optim: OptimConfig = MISSING
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    preemption: PreemptionConfig = field(default_factory=PreemptionConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    compile_cache: CompileCacheConfig = field(default_factory=CompileCacheConfig)
    preflight: PreflightConfig = field(default_factory=PreflightConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    sample: SampleConfig = field(default_factory=SampleConfig)


def hydra_subdir(mode) -> str:
    """``hydra.output_subdir`` for ``mode`` (the ``${xtrain_hydra_subdir:}`` resolver): a
    training's record is pending until accepted, the other modes' go to ``.hydra-<mode>``
    (xtrain/config/hydra_record.py)."""
    mode = getattr(mode, "value", mode)
    return PENDING if mode == Mode.train.value else f"{RECORD}-{mode}"


@dataclass
class SweeperConf(BasicSweeperConf):
    """``hydra/sweeper=xtrain``: Hydra's basic sweeper that checks every job first (xtrain/sweeps.py)."""

    _target_: str = "hydra_plugins.xtrain_launchers.sweeper.XtrainSweeper"


def register() -> None:
    """Register the schemas and resolvers (idempotent)."""
    ConfigStore.instance().store(name="train_schema", node=TrainConfig)
    # here, not in the plugin: a job launched on a worker composes without xtrain's plugins
    ConfigStore.instance().store(group="hydra/sweeper", name="xtrain", node=SweeperConf,
                                 provider="xtrain")
    from xtrain.naming import corpus_dir, run_dir_name, run_name, sweep_dir_resolver, sweep_name

    if not OmegaConf.has_resolver("xtrain_run_name"):
        OmegaConf.register_new_resolver("xtrain_run_name", run_name)
    if not OmegaConf.has_resolver("xtrain_run_dir_name"):
        OmegaConf.register_new_resolver("xtrain_run_dir_name", run_dir_name)
    if not OmegaConf.has_resolver("xtrain_corpus"):
        OmegaConf.register_new_resolver("xtrain_corpus", corpus_dir)
    if not OmegaConf.has_resolver("xtrain_hydra_subdir"):  # see conf/train.yaml
        OmegaConf.register_new_resolver("xtrain_hydra_subdir", hydra_subdir)
    if not OmegaConf.has_resolver("xtrain_sweep_name"):
        OmegaConf.register_new_resolver("xtrain_sweep_name", sweep_name)
    if not OmegaConf.has_resolver("xtrain_sweep_dir_name"):
        OmegaConf.register_new_resolver("xtrain_sweep_dir_name", sweep_dir_resolver)
    if not OmegaConf.has_resolver("xtrain_config_groups"):  # --help's list (conf/train.yaml)
        from xtrain.config.choices import config_groups

        OmegaConf.register_new_resolver("xtrain_config_groups", config_groups)
    if not OmegaConf.has_resolver("xtrain_cache"):  # ${xtrain_cache:}: see xtrain.paths.cache_root
        OmegaConf.register_new_resolver("xtrain_cache", lambda: str(cache_root()))


def to_plain(cfg) -> dict:
    """A config as plain JSON-ready containers (enums as their names), resolved."""
    return OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
