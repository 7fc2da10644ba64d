"""Hydra's side of launching: the task that runs a job on its workers instead of training here.
xtrain/cli.py calls :func:`launch_from_hydra` for a single run (Hydra hands jobs to a launcher only
in multirun mode); the plugin in launch/hydra_plugins/xtrain_launchers/ calls
:func:`launch_sweep` for every job of a multirun."""

from __future__ import annotations

import copy
import os
from pathlib import Path

from xtrain.config import Mode
from xtrain.config.choices import check_composed
from xtrain.config.hydra_record import hold, release, released_on_error
from xtrain.errors import ConfigError, is_refusal, refuse
from xtrain.launcher.fleet import Job, check_job, derive, run_on_vm
from xtrain.launcher.launch import hydra_str, launch_job, say
from xtrain.launcher.runner import LaunchError
from xtrain.naming import config_dirs_elsewhere, primary_config_name
from xtrain.paths import PRIMARY_CONFIG

# The launched jobs of this process's sweep that stopped before finishing (a signal, a notice, a
# preemption not survived): xtrain/cli.py then exits 143, as a single run stopped does
STOPPED_JOBS: list[str] = []


def prepare_from_hydra(cfg) -> Job:
    """The job of the current Hydra context, planned and checked here: a bad config (or a fleet
    setting that cannot work) is refused before anything is copied or any VM touched."""
    from hydra.core.hydra_config import HydraConfig

    from xtrain.modes import check_sampling, plan_run
    from xtrain.observe.console import ConsoleLog
    from xtrain.plan import check_fits

    hc = HydraConfig.get()
    check_composed(cfg, hc)  # also for the jobs of a sweep (Hydra's task for each)
    check_workers_compose_it(hc)
    launcher = hc.launcher
    where = launcher.tpu or ", ".join(launcher.pool or launcher.hosts)
    with ConsoleLog(None):
        plan = plan_run(cfg, f"{launcher.kind} {where}")
    if cfg.mode == Mode.train:
        check_fits(plan, cfg)
    check_sampling(cfg)
    check_job(launcher, cfg.hardware, cfg.checkpoint.dir)
    return Job(copy.deepcopy(launcher), copy.deepcopy(cfg.hardware), job_overrides(cfg, hc.overrides.task),
               cfg.run.name, hc.runtime.output_dir,
               cfg.checkpoint.dir, cfg.preemption.maintenance_lead_s)


def hold_record(job: Job) -> Job:
    """Hold the job's .hydra record in its dir (xtrain/config/hydra_record.py), once every check
    here passed (for every job of a pool's sweep); a stop holds none."""
    if not job.cfg.stop:
        job.record = hold(job.job_dir)
    return job


def check_workers_compose_it(hc) -> None:
    """The workers compose conf/train.yaml from the conf/ synced with the code, with the job's
    overrides: a job composed from another primary config, or with configs from another dir
    (``--config-name``, ``--config-path``, ``--config-dir``, ``hydra.searchpath``), would train
    something else there, so it is refused."""
    named = primary_config_name(hc) != PRIMARY_CONFIG
    elsewhere = ([f"--config-name={hc.job.config_name}"] if named else []) + \
        [f"configs from {path}" for path in config_dirs_elsewhere(hc)]
    if elsewhere:
        launcher = hc.runtime.choices.get("hydra/launcher")
        raise ConfigError(f"hydra/launcher={launcher}: {', '.join(elsewhere)}: the workers compose "
                          f"conf/{PRIMARY_CONFIG}.yaml from the synced conf/ with the job's "
                          "overrides alone; put the config in conf/experiment/<name>.yaml (`# "
                          "@package _global_`, as the ones there) and choose it with "
                          "+experiment=<name>")


def job_overrides(cfg, overrides) -> list[str]:
    """The job's own overrides, and its sweep's W&B group resolved here: on its workers the job
    runs alone, outside the sweep, where conf/logger/wandb.yaml's ``${xtrain_sweep_name:}`` gives
    no group."""
    overrides = list(overrides)
    wandb = cfg.logger.wandb
    given = any(o.lstrip("+~").startswith("logger.wandb.group=") for o in overrides)
    if wandb is not None and wandb.group and not given:
        overrides.append(f"logger.wandb.group={hydra_str(wandb.group)}")
    return overrides


def run_prepared(job: Job) -> dict:
    """A pool (of one job, for a single run), a TPU VM by name (preemption-aware, recreated when
    asked), or explicit hosts."""
    if job.cfg.stop:
        return stop(job)
    if job.cfg.pool:
        from xtrain.launcher.pool import run_pool

        (outcome,) = run_pool([job])
        if outcome.error is not None:
            raise outcome.error
        return outcome.result
    if job.cfg.tpu:
        return run_on_vm(job)
    return launch_job(job.cfg, job.hardware, job.overrides, job.run_name, job.job_dir,
                      record=job.record, checkpoint_dir=job.checkpoint_dir)


def launch_from_hydra(cfg) -> dict:
    job = hold_record(prepare_from_hydra(cfg))
    with released_on_error((job.job_dir, job.record)):
        return run_prepared(job)


def stop(job: Job) -> dict:
    """``hydra.launcher.stop=true``: stop the job wherever it runs (every VM of a pool; one that
    cannot be reached, or is not READY, is named once the others were tried)."""
    if not job.cfg.pool:
        return launch_job(job.cfg, job.hardware, job.overrides, job.run_name, job.job_dir)
    stopped, problems = False, []
    for vm in job.cfg.pool:
        try:
            stopped |= launch_job(derive(job.cfg, tpu=vm, pool=[]), job.hardware, job.overrides,
                                  job.run_name, job.job_dir)["stopped"]
        except (ConfigError, LaunchError) as e:  # a VM down or unreachable: the next ones
            say(f"fleet: TPU {vm}: {e}")
            problems.append(f"TPU {vm}: {e}")
    if problems:
        raise LaunchError(f"job {job.run_name}: {'stopped where it ran, ' if stopped else ''}"
                          f"not every VM of the pool could be asked: {'; '.join(problems)}")
    return {"stopped": stopped}


def launch_sweep(hydra_context, config, job_overrides, initial_job_idx: int) -> list:
    """Hydra's Launcher.launch: each job in turn, like Hydra's basic launcher, but run remotely.
    The sweep stops at the first job that fails: the next ones would meet the same workers.
    With ``pool`` the jobs are spread over the pool's VMs instead (:func:`launch_pool`)."""
    from hydra.core.utils import JobStatus

    if config.hydra.launcher.pool and not config.hydra.launcher.stop:
        return launch_pool(hydra_context, config, job_overrides, initial_job_idx)
    returns = []
    for ret in hydra_jobs(hydra_context, config, job_overrides, initial_job_idx,
                          launch_from_hydra):
        returns.append(ret)
        if ret.status == JobStatus.FAILED:
            exit_on_launch_error(ret)
            break
    note_stopped(returns)
    return returns


def note_stopped(returns) -> None:
    """Add the jobs that stopped before finishing (their result says preempted) to STOPPED_JOBS."""
    from hydra.core.utils import JobStatus

    for ret in returns:
        if ret.status == JobStatus.COMPLETED and (ret.return_value or {}).get("preempted"):
            STOPPED_JOBS.append(" ".join(ret.overrides) or "(no overrides)")


def hydra_jobs(hydra_context, config, job_overrides, initial_job_idx: int, task):
    """Hydra's run_job for each job in turn (its dir, .hydra/, logging), with ``task``."""
    from hydra.core.utils import configure_log, run_job, setup_globals
    from omegaconf import open_dict

    setup_globals()
    configure_log(config.hydra.hydra_logging, config.hydra.verbose)
    Path(str(config.hydra.sweep.dir)).mkdir(parents=True, exist_ok=True)
    for idx, overrides in enumerate(job_overrides, start=initial_job_idx):
        sweep_config = hydra_context.config_loader.load_sweep_config(config, list(overrides))
        with open_dict(sweep_config):
            sweep_config.hydra.job.id = sweep_config.hydra.job.num = idx
        yield run_job(hydra_context=hydra_context, task_function=task, config=sweep_config,
                      job_dir_key="hydra.sweep.dir", job_subdir_key="hydra.sweep.subdir")


def launch_pool(hydra_context, config, job_overrides, initial_job_idx: int) -> list:
    """Every job is prepared through Hydra first (its dir and config; a refusal ends the sweep
    before any VM is touched), then the pool runs them all and each JobReturn gets its job's
    result or error; a summary table ends the sweep."""
    from hydra.core.utils import JobStatus

    from xtrain.launcher.pool import outcome_rows, run_pool, summary

    returns = list(hydra_jobs(hydra_context, config, job_overrides, initial_job_idx,
                              refusing(prepare_from_hydra)))
    jobs = [ret.return_value for ret in returns]
    jobs = [hold_record(job) for job in jobs]
    with released_on_error(*[(job.job_dir, job.record) for job in jobs]):  # jobs left unrun
        outcomes = run_pool(jobs)
    for job, ret, outcome in zip(jobs, returns, outcomes):
        failed = outcome.error is not None or outcome.result is None
        if failed:  # as a single run's (xtrain/config/hydra_record.py)
            release(job.job_dir, job.record)
        ret.status = JobStatus.FAILED if failed else JobStatus.COMPLETED
        ret.return_value = outcome.error if failed else outcome.result
    table = summary(outcome_rows(jobs, outcomes))
    say("fleet: the sweep is over:\n" + table)
    with open(os.path.join(str(config.hydra.sweep.dir), "summary.txt"), "w") as f:
        f.write(table + "\n")
    for outcome in outcomes:
        if outcome.error is not None and is_refusal(outcome.error):
            refuse(outcome.error)
    note_stopped(returns)
    return returns


def refusing(task):
    """``task`` ending the process with the one line of a refusal (Hydra would add its own)."""
    def run(cfg):
        try:
            return task(cfg)
        except Exception as e:  # noqa: BLE001  (only refusals end here; the rest is raised)
            if is_refusal(e):
                refuse(e)
            raise
    return run


def exit_on_launch_error(ret) -> None:
    """A refused config or a failed worker ends the process with one clear line (exit 2 or 1);
    any other error is left to Hydra's own report."""
    try:
        ret.return_value
    except Exception as e:  # noqa: BLE001  (the job's own error, re-raised by Hydra)
        if is_refusal(e):
            refuse(e)
