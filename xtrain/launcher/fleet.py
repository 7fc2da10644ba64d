"""Spot TPU VMs: tell a preemption from a failed job or a network drop, and survive it.

Whenever a job's log stream or connection ends, the launcher asks gcloud for the VM's state
(xtrain/launcher/vm.py):

- the VM is not READY (PREEMPTED, TERMINATED, ...; a queued resource SUSPENDED): a preemption;
- the VM is READY and the job's process exited non-zero: a failure of the job, reported as such;
- the VM is READY and the process still runs: the network dropped; the launcher reattaches
  (``follow`` in xtrain/launcher/launch.py);
- the job stopped itself after a checkpoint (exit 143): a preemption if the VM goes down soon
  after, else the job's own stop; but one its run says was for a GCE notice is re-run all the
  same with ``recreate`` (:func:`attempt`, :class:`NoticeStop`).

With ``recreate=true`` a preempted VM is deleted (never left FAILED or SUSPENDED, holding quota),
created again with the profile's accelerator type and runtime version (``--spot``), retried with
backoff while the zone has no capacity (a quota the project lacks ends the recreation at once:
no wait lifts it), waited for until READY (bounded by ``ready_timeout_s``), set up again by the
ordinary launch (its new host key is accepted: xtrain deleted the old VM itself), and the job
re-run, which resumes from its newest committed checkpoint on GCS. The re-run's environment
carries the preemption history (xtrain/observe/preemptions.py), so the run's metrics record it.
xtrain/launcher/pool.py spreads a multirun over several such VMs.
"""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass

from xtrain.config.choices import check_known_keys
from xtrain.config.secrets import check_no_secret_values, declare_secret_names
from xtrain.errors import ConfigError, EnvironmentMismatch, InputError, TargetUnready
from xtrain.launcher.config import LauncherConfig
from xtrain.launcher.launch import launch_job, say
from xtrain.launcher.logs import kept_aside, last_logged_step, log_path, worker_logs
from xtrain.launcher.runner import LaunchError, Runner
from xtrain.launcher.ssh import Ssh, check_identity
from xtrain.launcher.targets import TARGET_REQUIRED, check_type
from xtrain.launcher.vm import DOWN, NO_ANSWER, NOT_FOUND, UP, Vm, VmLost, clock, vm_health
from xtrain.limits import out_of_range
from xtrain.observe.preemptions import NOTICE, launch_env
from xtrain.paths import is_local


class NoticeStop(VmLost):
    """The job stopped for a GCE notice and its VM stayed READY past the notice's lead (maintenance
    cancelled, done by live migration, or still to come: with ``recreate`` the VM takes no job
    until gcloud shows it over, Vm.wait_out_maintenance): a preemption whose VM needs no
    recreation, counted like one, so ``max_recreates`` bounds a VM that keeps sending notices.
    ``result``: the stopped job's, reported as it is when the launch does not re-run jobs."""

    result: dict = {}


@dataclass
class Job:
    """One job of a launch: the launcher's fields and what ``launch_job`` needs."""

    cfg: object  # hydra.launcher
    hardware: object
    overrides: list[str]
    run_name: str
    job_dir: str  # the local (Hydra) job dir
    checkpoint_dir: str | None = None  # checkpoint.dir (None: the run dir on the VM)
    notice_lead_s: float = 0.0  # preemption.maintenance_lead_s: a notice precedes the VM's loss
    record: str | None = None  # its .hydra record, held until its workers accept it

    @property
    def checkpoints_on_vm(self) -> bool:
        """Its checkpoints are on its VM's disk (they go with the VM)."""
        return is_local(self.checkpoint_dir or "")


@dataclass
class Preemptions:
    """What one job went through: preemptions, time lost, the furthest step logged before the
    latest one."""

    count: int = 0
    time_lost_s: float = 0.0
    steps_seen: int | None = None
    seen_at: float | None = None  # the latest preemption, until the job is launched again

    def record(self, lost: VmLost, job: Job) -> None:
        """Count ``lost``; keep the preempted attempt's log beside the next one's."""
        self.count += 1
        self.seen_at = lost.seen_at
        path = log_path(job.job_dir, 0)
        if os.path.exists(path):
            self.steps_seen = last_logged_step(path) or self.steps_seen
        for index in worker_logs(job.job_dir):  # every worker's: the re-run starts each afresh
            os.replace(log_path(job.job_dir, index), kept_aside(job.job_dir, index))

    def relaunching(self) -> dict[str, str]:
        """The re-run's environment; the time since the preemption was seen counts as lost."""
        if self.seen_at is not None:
            self.time_lost_s += time.monotonic() - self.seen_at
            self.seen_at = None
        return launch_env(self.count, self.time_lost_s, self.steps_seen) if self.count else {}

    def lost_so_far(self) -> float:
        return self.time_lost_s + (time.monotonic() - self.seen_at if self.seen_at else 0.0)

    def summary(self) -> dict:
        return {"preemptions": self.count, "time_lost_s": round(self.time_lost_s, 1)}


def derive(cfg, **changes):
    """A copy of the launcher's fields with ``changes`` (Hydra's own copy is read-only)."""
    from omegaconf import OmegaConf

    return OmegaConf.create({**OmegaConf.to_container(cfg, resolve=True), **changes})


# A job stopped by a signal saves a checkpoint and exits 143 while its VM may still be READY (a
# spot VM is stopped about 30 s after its SIGTERM): the fleet watches the VM this long before
# taking the stop for one that was not a VM's loss (a signal sent by hand). After a GCE notice it
# watches the job's maintenance lead longer (a window may start that long after the notice).
VM_DOWN_WAIT_S = 180.0


def attempt(vm: Vm, job: Job, history: Preemptions, log=say, looked: bool = True) -> dict:
    """Run ``job`` on ``vm`` once. Raises VmLost when the VM went down under it (or was found
    down while launching, or went down after the job stopped for a signal or a notice),
    NoticeStop when the job stopped for a GCE notice and the VM stayed up, VmUnavailable when the
    READY VM refused the job before it started, and anything else as the job's own failure.
    ``looked``: the fleet found the VM up before (else the launch's look at it is the first, and
    a VM it finds not READY, or unknown, is a refused target)."""
    env = {**job.cfg.env, **history.relaunching()}
    cfg = derive(job.cfg, tpu=vm.name, pool=[], hosts=[], env=env)
    try:
        result = launch_job(cfg, job.hardware, job.overrides, job.run_name, job.job_dir,
                            Runner(), log, vm_check=vm.check, record=job.record,
                            checkpoint_dir=job.checkpoint_dir)
    except TargetUnready as e:  # the VM (or gcloud) changed since the fleet looked: ask again
        if not looked:
            raise
        state = vm.answer()
        if state != NO_ANSWER and vm_health(state, vm.cfg.queued) != UP:
            raise VmLost(vm.name, state) from e
        raise LaunchError(f"{e} (asked again: {state})") from e  # not a refused input
    except (VmLost, InputError):  # a refused input is never a preemption, whatever the VM's state
        raise
    except LaunchError as e:
        state = vm.answer()  # no answer: the job's own failure, as far as is known
        if state != NO_ANSWER and vm_health(state, vm.cfg.queued) != UP:
            raise VmLost(vm.name, state) from e
        raise
    result = {**result, **history.summary(), "vm": vm.name}
    if result.get("preempted"):  # the run's stop record says why (xtrain/observe/preemptions.py)
        notice = result.get("stopped_for") == NOTICE
        try:
            wait_for_vm_loss(vm, VM_DOWN_WAIT_S + (job.notice_lead_s if notice else 0.0), log,
                             notice)
        except NoticeStop as stop:
            stop.result = result  # what a launch without recreate reports
            raise
    return result


def wait_for_vm_loss(vm: Vm, wait_s: float, log=say, notice: bool = False) -> None:
    """After the job stopped (exit 143) for a signal or, with ``notice``, a GCE notice: raise
    VmLost (lost since the stop) if ``vm`` goes down within ``wait_s``. Otherwise a notice's stop
    raises NoticeStop and a signal's returns: it was the job's own."""
    log(f"fleet: the job on {vm} stopped for {'a GCE notice' if notice else 'a signal'}; "
        f"watching the VM for up to {wait_s:g} s")
    stopped = time.monotonic()
    while True:
        state = vm.answer()  # no answer: asked again until the wait is over
        if state == NO_ANSWER:
            state = "up as far as is known (gcloud did not answer)"
        elif vm_health(state, vm.cfg.queued) != UP:
            raise VmLost(vm.name, state, stopped)
        if time.monotonic() - stopped >= wait_s:
            break
        time.sleep(vm.cfg.poll_s)
    if notice:
        raise NoticeStop(vm.name, state, stopped, f"is still {state} after the job's GCE notice")
    log(f"fleet: {vm} is still {state}: the stop was the job's own, not a preemption")


def preempted(vm: Vm, job: Job, history: Preemptions, lost: VmLost, log=say) -> None:
    """Record the preemption and log it; raises LaunchError when the job's budget is spent."""
    history.record(lost, job)
    log(f"fleet: {lost}: job {job.run_name} preempted{_at(history)} (preemption "
        f"{history.count}); {clock(history.lost_so_far())} lost so far")
    if history.count > job.cfg.max_recreates:
        where = f" (its checkpoints stay in {job.checkpoint_dir})" if job.checkpoint_dir else ""
        raise LaunchError(f"job {job.run_name}: preempted {history.count} times, more than "
                          f"hydra.launcher.max_recreates={job.cfg.max_recreates}: giving up{where}; "
                          "run the same command to resume")


def _at(history: Preemptions) -> str:
    return f" at step {history.steps_seen}" if history.steps_seen is not None else ""


def run_on_vm(job: Job, log=say) -> dict:
    """``hydra.launcher.tpu=NAME``: run the job there; with ``recreate``, recreate the VM when it
    is preempted (or found preempted) and re-run the job until it ends or the budget is spent (a
    job stopped for a GCE notice is re-run on the same VM when that stayed up: NoticeStop)."""
    vm = Vm(job.cfg.tpu, job.cfg, job.hardware, log=log)
    history = Preemptions()
    if job.cfg.recreate:
        check_known(vm, recreate=True)
        if vm.health() != UP:  # found preempted: recreated before the job starts
            vm.restore()
    while True:
        try:
            return attempt(vm, job, history, log, looked=bool(job.cfg.recreate))  # (check_known)
        except VmLost as lost:
            if isinstance(lost, NoticeStop) and not job.cfg.recreate:
                log(f"fleet: {lost}: the job stopped for its notice; run the same command to "
                    "resume (hydra.launcher.recreate=true re-runs it unattended)")
                return lost.result
            preempted(vm, job, history, lost, log)
            if not job.cfg.recreate:
                raise LaunchError(f"{lost}: job {job.run_name} was preempted{_at(history)}; "
                                  + after_preemption(lost, job)) from None
            if isinstance(lost, NoticeStop):
                vm.wait_out_maintenance(job.notice_lead_s)
        vm.restore(history.lost_so_far)
        log(f"fleet: re-running {job.run_name} on {vm} (it resumes from its newest committed "
            "checkpoint)")


def after_preemption(lost: VmLost, job: Job) -> str:
    """What to do once a job was preempted on a VM the launcher does not recreate: a VM coming up
    by itself is waited for; a preempted one never comes back READY (it is deleted and created
    again), and checkpoints on its disk go with it."""
    if vm_health(lost.state, job.cfg.queued) != DOWN:
        return "run the same command once the VM is READY"
    where = job.checkpoint_dir or "the run dir on the VM"
    kept = (f"it resumes from its newest checkpoint in {where}" if not job.checkpoints_on_vm
            else f"its checkpoints in {where} go with the VM's disk, so it will train from step 0 "
            "again (checkpoint.dir=gs://... keeps them)")
    again = "create it again" if lost.state == NOT_FOUND else "delete it and create it again"
    return (f"it does not come back READY by itself: {again}, then run the same command "
            f"({kept}); hydra.launcher.recreate=true with checkpoint.dir=gs://... does that "
            "unattended")


def check_job(cfg, hardware, checkpoint_dir: str | None) -> None:
    """Refuse a fleet config that cannot work, before any VM is touched."""
    check_known_keys(cfg, "hydra.launcher.")
    declare_secret_names(cfg.secrets)  # (as the launch forwards them: secrets whatever their names)
    check_no_secret_values(cfg, "hydra.launcher.", resolved=True)
    problems = out_of_range(cfg, LauncherConfig, "hydra.launcher.")
    if problems:
        raise ConfigError("; ".join(problems))
    if not (cfg.pool or cfg.tpu or cfg.hosts):
        raise ConfigError(TARGET_REQUIRED)
    if cfg.pool:
        if cfg.tpu or cfg.hosts:
            raise ConfigError("hydra.launcher.pool names the VMs: give pool, tpu or hosts, not two")
        if cfg.kind != "vm" or hardware.hosts > 1:
            raise ConfigError(f"hydra.launcher.pool with hardware={hardware.name} "
                              f"({hardware.hosts} hosts): pools are single-host TPU VMs "
                              "(hydra/launcher=tpu_vm)")
        if len(set(cfg.pool)) != len(cfg.pool):
            raise ConfigError(f"hydra.launcher.pool={list(cfg.pool)} names a VM twice")
    if (cfg.pool or cfg.tpu) and not cfg.zone:
        raise ConfigError("hydra.launcher.zone is required with hydra.launcher.tpu or pool")
    if (cfg.pool or cfg.tpu) and shutil.which("gcloud") is None:
        raise EnvironmentMismatch("gcloud is not on PATH: hydra.launcher.tpu and pool find their "
                                  "VMs with the Google Cloud CLI (install it), hydra.launcher.hosts"
                                  "=[...] takes addresses instead")
    if cfg.recreate:
        check_recreate(cfg, hardware, checkpoint_dir)
    check_identity(cfg)
    if cfg.recreate:
        Ssh(cfg, Runner()).authorized_key()  # the key a recreated VM gets: readable, or refused now


def check_recreate(cfg, hardware, checkpoint_dir: str | None) -> None:
    if not (cfg.tpu or cfg.pool):
        raise ConfigError("hydra.launcher.recreate=true needs hydra.launcher.tpu (or pool): "
                          "hosts given by address cannot be recreated")
    if not str(checkpoint_dir or "").startswith("gs://"):
        raise ConfigError(f"hydra.launcher.recreate=true needs checkpoint.dir=gs://...: a "
                          "recreated VM starts with an empty disk, so checkpoints in "
                          f"{checkpoint_dir or 'the run dir on the VM'} would be lost with it")
    if not (hardware.accelerator_type and hardware.runtime_version):
        raise ConfigError(f"hydra.launcher.recreate=true: hardware={hardware.name} names no "
                          "accelerator_type and runtime_version to create the VM with")


def check_known(vm: Vm, recreate: bool) -> None:
    """Refuse a VM gcloud does not know (a misspelt name must never create a VM) unless xtrain
    deleted it for a recreation it did not finish (Vm.deletion_mark: created again with
    ``recreate``), or one of another type; without ``recreate``, one that is not READY."""
    try:
        found = vm.describe()
    except LaunchError as e:  # (gcloud's auth, say) refused, as an unanswered target is
        raise ConfigError(str(e)) from e
    deleted = vm.deleted_at() if found is None else None
    if found is not None:  # created since, by hand maybe: the note is over
        vm.deletion_mark.unlink(missing_ok=True)
    if deleted and recreate:  # xtrain deleted it for a recreation it did not finish: created now
        return
    if deleted:
        raise ConfigError(f"{vm} is gone: xtrain deleted it at {deleted} to recreate it, and did "
                          "not create it again (no capacity in time, or the launch stopped); "
                          "hydra.launcher.recreate=true creates it")
    if found is None:
        raise ConfigError(f"gcloud does not know {vm} in {vm.cfg.zone}"
                          + (" (queued resource)" if vm.cfg.queued else ""))
    state = vm.state()
    if not recreate and vm_health(state, vm.cfg.queued) != UP:
        raise ConfigError(f"{vm} is {state}, not READY (hydra.launcher.recreate=true recreates "
                          "a preempted VM)")
    if vm.cfg.queued:  # the queued resource holds its node's spec
        found = (found.get("tpu", {}).get("nodeSpec") or [{}])[0].get("node", {})
    check_type(found, vm.hardware, str(vm))
