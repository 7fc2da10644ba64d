"""The ``logger`` config group (conf/logger/) made into a run's :class:`RunLog`: JSONL always,
W&B and TensorBoard when chosen (each option's ``_target_`` built with Hydra's ``instantiate``),
and the console display. Only the first process (rank 0) logs; the others get an empty RunLog.

Why JSONL is xtrain's own sink rather than Lightning's CSVLogger: records of different kinds
carry different keys, and CSVLogger rewrites its whole file (header and all) whenever a new key
appears; JSONL appends, and ``metrics.jsonl`` is the format the README, the plots and the report
read. The W&B run is started by xtrain (xtrain/observe/wandb_run.py says why) and logged to
through Lightning's WandbLogger; TensorBoard is Lightning's TensorBoardLogger as it is. The
loggers are not handed to Lightning's Trainer (``logger=False``): records come from xtrain's
callbacks and from the checkpoint upload thread, not from ``LightningModule.log``, which would
reduce values on the device at every step.
"""

from __future__ import annotations

import re

from xtrain.config import JsonlLoggerConfig
from xtrain.observe.bundle import git_remote_url, mask_secrets, source_git_root
from xtrain.observe.console import ProgressDisplay
from xtrain.observe.sinks import LightningSink, RunLog
from xtrain.paths import cache_root, is_local

TENSORBOARD_DIR = "tensorboard"


def local_dir(run_dir: str) -> str:
    """Where loggers that need a local directory (W&B, TensorBoard) write: the run dir, or for a
    remote one (gs://...) a mirror under the cache root."""
    if is_local(run_dir):
        return run_dir.removeprefix("file://")
    return str(cache_root() / "runs" / re.sub(r"[^A-Za-z0-9._-]+", "_", run_dir))


# W&B refuses a project's name over 128 characters or holding one of these, and a tag outside
# 1..64 characters, at wandb.init (wandb 0.31: wandb/sdk/wandb_settings.py), after the data and
# the model are built
WANDB_PROJECT_FORBIDDEN, WANDB_PROJECT_CHARS = "/\\#?%:", 128
WANDB_TAG_CHARS = (1, 64)


def check_logger_settings(logger_cfg) -> None:
    """What the chosen loggers would refuse, or do wrong, only once training starts: a W&B
    project name or tag W&B refuses, a TensorBoard name or version that is not one directory's
    name (``../x`` writes outside the run dir)."""
    from xtrain.errors import ConfigError

    wandb, tensorboard = logger_cfg.wandb, logger_cfg.tensorboard
    if wandb is not None:
        if set(wandb.project) & set(WANDB_PROJECT_FORBIDDEN) or len(wandb.project) > WANDB_PROJECT_CHARS:
            raise ConfigError(f"logger.wandb.project={wandb.project!r}: W&B takes names of up to "
                              f"{WANDB_PROJECT_CHARS} characters, none of {' '.join(WANDB_PROJECT_FORBIDDEN)}")
        low, high = WANDB_TAG_CHARS
        for tag in wandb.tags:
            if not low <= len(tag) <= high:
                raise ConfigError(f"logger.wandb.tags: {tag!r} has {len(tag)} characters; W&B "
                                  f"takes tags of {low} to {high}")
    for key in ("name", "version"):
        value = tensorboard[key] if tensorboard is not None else ""
        if value and (value in (".", "..") or "/" in value):
            raise ConfigError(f"logger.tensorboard.{key}={value!r}: one directory's name under "
                              f"<run dir>/{TENSORBOARD_DIR}, no path")


def build_run_log(logger_cfg, run_dir: str, run_name: str, config: dict, max_steps: int,
                  start_step: int = 0, rank: int = 0) -> RunLog:
    """``config``: the resolved config (uploaded with secrets masked)."""
    from hydra.utils import instantiate

    if rank != 0:
        return RunLog([])
    masked = mask_secrets(config)
    sinks = [instantiate(logger_cfg.jsonl or JsonlLoggerConfig(), run_dir=run_dir)]
    local = local_dir(run_dir)
    if logger_cfg.wandb is not None:
        git_root = source_git_root()
        # partial, then called: runtime values passed through instantiate would become config
        # nodes (and the config's own _target_ keys would be instantiated)
        wandb_logger = instantiate(logger_cfg.wandb, _partial_=True, _convert_="all")
        sinks.append(LightningSink(wandb_logger(
            run_dir=run_dir, local_dir=local, run_name=run_name, run_config=masked,
            git_root=str(git_root) if git_root else None,
            git_remote_url=git_remote_url(git_root) if git_root else None,
            start_step=start_step)))
    if logger_cfg.tensorboard is not None:
        # a resume redoes the steps after its checkpoint, and a start over (killed before its
        # first checkpoint) every step: TensorBoard hides their earlier values
        tensorboard = instantiate(logger_cfg.tensorboard, save_dir=f"{local}/{TENSORBOARD_DIR}",
                                  purge_step=start_step + 1)
        tensorboard.log_hyperparams(masked)
        sinks.append(LightningSink(tensorboard))
    sinks.append(ProgressDisplay(max_steps, start_step))
    return RunLog(sinks)
