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
