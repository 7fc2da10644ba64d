"""A sweep (``-m``) checks every job's config before its first job runs: a job refused only when
its turn came would let the jobs before it run (hours on a TPU) and then end the sweep there.

Hydra's basic sweeper composes each job of a batch first, only to see that it composes; xtrain's
sweeper (``hydra/sweeper=xtrain``: its config in xtrain/config/, its class in
launch/hydra_plugins/xtrain_launchers/sweeper.py) calls :func:`check_jobs` there instead,
whatever the launcher. What reads paths or storage is still checked by each job as it starts.
A sweep refused by these checks, or one that leaves no job dir (plans, compiles for a TPU, jobs
refused before they kept anything), leaves the sweep dir as it found it, and one whose jobs keep
no dir puts back an earlier sweep's record it replaced (:class:`SweepRecord`).
"""

from __future__ import annotations

import contextlib
import copy
import os
from pathlib import Path

from xtrain.config.hydra_record import SWEEP_RECORD


def check_jobs(config_loader, sweep_config, batch) -> bool:
    """Compose each job of ``batch`` (lists of overrides) and run xtrain's checks of its config
    (xtrain/modes.py's check_config); the first refusal names its job and ends the sweep. True if
    a job keeps its dir (its mode is no plan or compile run here)."""
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import open_dict

    from xtrain.config.choices import check_composed
    from xtrain.errors import ConfigError, is_refusal
    from xtrain.launcher import is_remote
    from xtrain.launcher.fleet import check_job
    from xtrain.launcher.hydra_jobs import check_workers_compose_it
    from xtrain.modes import check_config, check_host_memory

    checkpoint_dirs: dict[str, tuple[int, str]] = {}  # a checkpoint dir -> (its job, run name)
    launched: dict[str, int] = {}  # a launched job's run name and job dir -> its job
    run_dirs: dict[str, int] = {}  # a local training's run dir -> its job
    keeps = False
    try:
        for number, overrides in enumerate(batch, start=1):
            loaded = config_loader.load_sweep_config(master_config=sweep_config,
                                                     sweep_overrides=list(overrides))
            with open_dict(loaded):  # numbered as the launcher numbers it (its dir may use that)
                loaded.hydra.job.num = loaded.hydra.job.id = number - 1
            HydraConfig.instance().set_config(loaded)  # its resolvers (the run name) see this job
            # the job's own config apart; Hydra's stays in `loaded`, where its dirs can still
            # name the job's fields (${run.name})
            hydra_cfg, job = loaded.hydra, copy.deepcopy(loaded)
            with open_dict(job):
                del job["hydra"]
            try:
                check_composed(job, hydra_cfg)
                run_dir, remote = job_dir_in_sweep_dir(hydra_cfg), is_remote(hydra_cfg.launcher)
                if remote:
                    check_launched_apart(job, run_dir, number, launched)
                    check_workers_compose_it(hydra_cfg)
                check_config(job)
                if not remote:  # (a launch checks it on its workers)
                    check_host_memory(job)
                # (a launched job's run dir is on its worker: only an explicit dir is shared)
                check_own_checkpoint_dir(job, None if remote else run_dir, number, checkpoint_dirs)
                if remote:  # the fleet's: keys, zone, gcloud, pool
                    check_job(hydra_cfg.launcher, job.hardware, job.checkpoint.dir)
                else:
                    check_own_run_dir(job, run_dir, number, run_dirs)
                keeps = keeps or remote or not job.mode.keeps_nothing
            except Exception as e:  # noqa: BLE001  (a refusal names the job; the rest is raised)
                if not is_refusal(e):
                    raise
                raise ConfigError(f"sweep job {number} of {len(batch)} ({' '.join(overrides)}): "
                                  f"{e}; no job was run") from e
    finally:
        HydraConfig.instance().set_config(sweep_config)
    return keeps


def job_dir_in_sweep_dir(hydra_cfg) -> str:
    """A sweep job's dir (``hydra.sweep.subdir`` joined to ``hydra.sweep.dir`` as Hydra's run_job
    joins them), refused outside the sweep's dir or as that dir itself (a subdir that is absolute,
    climbs out with ``..`` or is empty): the sweep's record (:class:`SweepRecord`) and
    ``xtrain.report`` find a sweep's jobs in its dir, one dir each."""
    from omegaconf import OmegaConf

    from xtrain.errors import ConfigError

    sweep_dir, subdir = (str(OmegaConf.select(hydra_cfg, f"sweep.{key}")) for key in ("dir", "subdir"))
    run_dir = os.path.join(sweep_dir, subdir)
    inside = os.path.relpath(os.path.abspath(run_dir), os.path.abspath(sweep_dir))
    if inside.split(os.sep)[0] == SWEEP_RECORD:
        raise ConfigError(f"hydra.sweep.subdir={subdir} puts the job in {run_dir}, where Hydra keeps "
                          "the sweep's record; give the jobs dirs of other names")
    if inside == "." or inside.split(os.sep)[0] == "..":
        raise ConfigError(f"hydra.sweep.subdir={subdir} puts the job in {run_dir}, not in a dir "
                          f"of its own inside the sweep's dir {sweep_dir}, where the sweep's record "
                          "and xtrain.report find its jobs; to put a sweep elsewhere, set "
                          "hydra.sweep.dir")
    return run_dir


def check_launched_apart(job, run_dir: str, number: int, taken: dict[str, int]) -> None:
    """A launched job is found on its workers by its run name (its run dir there, a pool's
    lookup of where it ran) and here by its job dir (its launch record, its W&B id): jobs sharing
    either would take over each other's runs. ``taken``: the keys of the jobs before."""
    from xtrain.errors import ConfigError
    from xtrain.launcher.launch import job_name

    for key, shared in ((f"name {job_name(job.run.name)}", f"is run {job.run.name} too"),
                        (f"dir {os.path.abspath(run_dir)}", f"has this job's dir {run_dir} too")):
        first = taken.setdefault(key, number)
        if first != number:
            raise ConfigError(f"sweep job {first} {shared}: a launched job's run is found by its "
                              "name on the workers and by its dir here; give each job its own "
                              "name (e.g. without run.name: a sweep's jobs are named by their "
                              "overrides) and its own dir (hydra.sweep.subdir, by default the name)")


def check_own_run_dir(job, run_dir: str, number: int, taken: dict[str, int]) -> None:
    """Trainings given checkpoint dirs apart but one run dir (one ``run.name``) would still share
    its metrics.jsonl, console.log and lock: the second was refused there only once the first had
    trained. ``taken``: the run dirs of the trainings before."""
    from xtrain.config import Mode
    from xtrain.errors import ConfigError

    if job.mode != Mode.train:
        return
    first = taken.setdefault(os.path.abspath(run_dir), number)
    if first != number:
        raise ConfigError(f"sweep job {first} has this job's run dir {run_dir} too: two trainings "
                          "in one run dir write one metrics.jsonl and console.log; give each job "
                          "its own name, e.g. without run.name (a sweep's jobs are named by their "
                          "overrides), or its own hydra.sweep.subdir")


def check_own_checkpoint_dir(job, run_dir: str | None, number: int,
                             taken: dict[str, tuple[int, str]]) -> None:
    """Trainings given one checkpoint dir take each other's checkpoints (each would resume from,
    or prune, the other's), so each job trains in its own: an explicit ``checkpoint.dir``, or its
    run dir's (which jobs given one ``run.name`` share, or one ``hydra.sweep.subdir``; ``run_dir``
    None: not known here). ``taken`` maps the dirs of the jobs before to their number and run
    name (this one's recorded in it)."""
    from xtrain.config import Mode
    from xtrain.errors import ConfigError
    from xtrain.inputs import checkpoint_dir
    from xtrain.paths import location

    if job.mode != Mode.train:
        return
    if run_dir is None and not job.checkpoint.dir:
        return
    directory = checkpoint_dir(job, run_dir).rstrip("/")
    # (ckpt, ./ckpt, file://...: one dir)
    first, first_name = taken.setdefault(location(directory), (number, job.run.name))
    if first == number:
        return
    if job.checkpoint.dir:
        raise ConfigError(f"checkpoint.dir={directory} is sweep job {first}'s too: two trainings in "
                          "one checkpoint dir take each other's checkpoints; give each job its own, "
                          f"e.g. 'checkpoint.dir={directory}/${{run.name}}'")
    if first_name != job.run.name:  # named apart, but given one dir
        raise ConfigError(f"sweep job {first} (run {first_name}) has this job's run dir too (its "
                          f"checkpoints in {directory}): two trainings in one run dir take each "
                          "other's checkpoints; give each job a dir of its own with "
                          "hydra.sweep.subdir (by default the job's run name)")
    raise ConfigError(f"sweep job {first} is run {job.run.name} too (its checkpoints in "
                      f"{directory}): two trainings in one run dir take each other's checkpoints; "
                      "give each job its own name, e.g. without run.name (a sweep's jobs are named "
                      "by their overrides) or with 'run.name=lr_${optim.matrix_lr}'")


class SweepRecord:
    """The sweep dir's ``multirun.yaml``, which Hydra writes before the jobs are checked, as it
    was before this sweep: a refused sweep, or one that leaves no job dir beside it, puts back
    what it replaced (an earlier sweep's record in the same dir), or removes it and the dirs
    Hydra made for it (``multirun/<sweep>``); so does one whose jobs keep no dir, when it
    replaced an earlier record."""

    def __init__(self, sweep_dir: str):
        self.path = Path(sweep_dir) / SWEEP_RECORD
        self.before = self.path.read_bytes() if self.path.is_file() else None
        self.made_dirs = []  # innermost first
        directory = self.path.parent.absolute()
        while not directory.exists():
            self.made_dirs.append(directory)
            directory = directory.parent

    @contextlib.contextmanager
    def restored_if_refused(self):
        from xtrain.errors import is_refusal

        try:
            yield
        except Exception as e:
            if is_refusal(e):
                self.restore()
            raise

    def restore_if_no_jobs(self, jobs_keep_dirs: bool | None) -> None:
        """Put the dir back when nothing but this sweep's record is left in it, and put back an
        earlier sweep's record when this sweep's jobs keep no dir (:func:`check_jobs`; None: not
        known): plans in a training sweep's dir do not replace its record."""
        alone = self.path.is_file() and [p.name for p in self.path.parent.iterdir()] == [self.path.name]
        if alone or (jobs_keep_dirs is False and self.before is not None):
            self.restore()

    def restore(self) -> None:
        if self.before is not None:
            self.path.write_bytes(self.before)
            return
        self.path.unlink(missing_ok=True)
        for directory in self.made_dirs:
            with contextlib.suppress(OSError):
                directory.rmdir()
