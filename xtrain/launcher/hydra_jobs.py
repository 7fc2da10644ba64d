"""Hydra's side of launching: the task that runs a job on its workers instead of training here.
xtrain/cli.py calls :func:`launch_from_hydra` for a single run (Hydra hands jobs to a launcher only
in multirun mode); the plugin in launch/hydra_plugins/xtrain_launchers/ calls
:func:`launch_sweep` for every job of a multirun."""

from __future__ import annotations

from pathlib import Path

from xtrain.config import Mode
from xtrain.errors import is_refusal, refuse
from xtrain.launcher.launch import launch_job


def launch_from_hydra(cfg) -> dict:
    """The job of the current Hydra context: planned and checked here (a bad config is refused
    before anything is copied), then run on the workers by :func:`launch_job`."""
    from hydra.core.hydra_config import HydraConfig

    from xtrain.modes import plan_run
    from xtrain.observe.console import ConsoleLog
    from xtrain.plan import check_fits

    hc = HydraConfig.get()
    where = hc.launcher.tpu or ", ".join(hc.launcher.hosts)
    with ConsoleLog(None):
        plan = plan_run(cfg, f"{hc.launcher.kind} {where}")
    if cfg.mode == Mode.train:
        check_fits(plan, cfg)
    return launch_job(hc.launcher, cfg.hardware, list(hc.overrides.task), cfg.run.name,
                      hc.runtime.output_dir)


def launch_sweep(hydra_context, config, job_overrides, initial_job_idx: int) -> list:
    """Hydra's Launcher.launch: each job in turn, like Hydra's basic launcher, but run remotely.
    The sweep stops at the first job that fails: the next ones would meet the same workers."""
    from hydra.core.utils import JobStatus, configure_log, run_job, setup_globals
    from omegaconf import open_dict

    setup_globals()
    configure_log(config.hydra.hydra_logging, config.hydra.verbose)
    Path(str(config.hydra.sweep.dir)).mkdir(parents=True, exist_ok=True)
    returns = []
    for idx, overrides in enumerate(job_overrides, start=initial_job_idx):
        sweep_config = hydra_context.config_loader.load_sweep_config(config, list(overrides))
        with open_dict(sweep_config):
            sweep_config.hydra.job.id = sweep_config.hydra.job.num = idx
        ret = run_job(hydra_context=hydra_context, task_function=launch_from_hydra,
                      config=sweep_config, job_dir_key="hydra.sweep.dir",
                      job_subdir_key="hydra.sweep.subdir")
        returns.append(ret)
        if ret.status == JobStatus.FAILED:
            exit_on_launch_error(ret)
            break
    return returns


def exit_on_launch_error(ret) -> None:
    """A refused config or a failed worker ends the process with one clear line (exit 2 or 1);
    any other error is left to Hydra's own report."""
    try:
        ret.return_value
    except Exception as e:  # noqa: BLE001  (the job's own error, re-raised by Hydra)
        if is_refusal(e):
            refuse(e)
