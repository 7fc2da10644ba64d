"""Schemas of what a run writes besides checkpoints: its loggers (the ``logger`` group) and its
text samples (``sample``). Re-exported by :mod:`xtrain.config`."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from xtrain.limits import limits


class WandbMode(str, Enum):
    """How the W&B logger reaches W&B (xtrain/observe/wandb_run.py)."""

    auto = "auto"  # WANDB_MODE if set, else online with a key (WANDB_API_KEY or ~/.netrc), offline without
    online = "online"  # refused without a key (never W&B's interactive login prompt)
    offline = "offline"  # files under <run dir>/wandb; `wandb sync` uploads them later


@dataclass
class JsonlLoggerConfig:
    """``metrics.jsonl`` in the run dir, through fsspec. Always on, chosen or not."""

    _target_: str = "xtrain.observe.sinks.JsonlSink"


@dataclass
class WandbLoggerConfig:
    """A W&B run, logged through Lightning's WandbLogger. The key is read from WANDB_API_KEY in
    the environment only: configs are written into every run dir. The run id is kept in the run
    dir (``wandb-run-id``): a resumed run continues its W&B run, a fresh run dir starts a new one."""

    _target_: str = "xtrain.observe.wandb_run.wandb_logger"
    project: str = "xtrain"
    entity: str | None = None  # None: the key's default entity
    # runs grouped in W&B; None: the run's name, which groups its starts (an offline start is a
    # W&B run of its own); conf/logger/wandb.yaml sets a sweep's name in a sweep
    group: str | None = None
    tags: list[str] = field(default_factory=list)
    mode: WandbMode = WandbMode.auto


@dataclass
class TensorBoardLoggerConfig:
    """Event files in ``<run dir>/tensorboard`` (a local run dir: TensorBoard writes no gs://)."""

    _target_: str = "lightning.pytorch.loggers.TensorBoardLogger"
    name: str = ""  # subdirectory names under <run dir>/tensorboard; empty: none
    version: str = ""
    default_hp_metric: bool = False  # no placeholder hp_metric scalar


@dataclass
class LoggerConfig:
    """The ``logger`` group: several options at once, e.g. ``logger=[jsonl,wandb,tensorboard]``;
    an option that is not chosen stays null. Every logger writes from rank 0 only."""

    jsonl: JsonlLoggerConfig | None = None
    wandb: WandbLoggerConfig | None = None
    tensorboard: TensorBoardLoggerConfig | None = None


@dataclass
class SampleConfig:
    """Text generation: what ``mode=sample`` prints, and the prompts and settings of training's
    samples (``trainer.sample_every``, ``trainer.sample_tokens``)."""

    prompts: list[str] = field(default_factory=lambda: ["#include <", "int main("])
    prompt: str | None = None  # one prompt instead of `prompts` (command-line friendly)
    n: int = limits(1, ge=1)  # samples per prompt (mode=sample)
    max_tokens: int = limits(128, ge=1)  # new tokens per sample (mode=sample)
    temperature: float = limits(0.8, ge=0)  # 0: greedy
    top_k: int | None = limits(50, ge=1)  # sample among the k likeliest tokens; None: all
    seed: int = limits(42, ge=0, le=2**32 - 1)  # (prompt i samples with seed + i)


def sample_prompts(sample) -> list[str]:
    """The prompts a ``sample`` config asks for."""
    return [sample.prompt] if sample.prompt is not None else list(sample.prompts)
