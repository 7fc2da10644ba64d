"""A pool of single-host TPU VMs for a multirun: ``hydra.launcher.pool=[vm-a,vm-b,...]``.

One thread per VM takes the next job from one queue, so every VM runs one job at a time and the
next job goes to the first free VM. A job whose VM is preempted goes back to the front of the
queue: to another VM, or to the same one once it is recreated (``recreate=true``); without
``recreate`` the preempted VM leaves the pool. A job that stopped for its VM's GCE notice while
the VM stayed up (fleet.NoticeStop) is handled the same way, the VM needing no recreation (with
``recreate`` it takes no job while gcloud shows its maintenance: Vm.wait_out_maintenance),
except that a job with its checkpoints on that VM's disk (no ``recreate`` then) ends stopped,
for the same command to resume it there. A VM
that refuses a job before starting it (another job or program holds it, unreachable, a failed
setup) leaves the pool too, and the job goes back to the queue for another VM; once every VM has
left, the jobs not run fail, naming why each VM left. A job still running on one of the VMs
from an earlier launch of the same sweep (the local side was gone), or ended there unwatched, is
reattached there (its end reported), never started a second time elsewhere; a job that ran on a
VM before with its checkpoints on that VM's disk runs there again. Such jobs fail, naming the VM,
when it leaves the pool up (a notice, a refusal); a VM lost with its disk (preempted) frees them
for any VM. Each job keeps its own Hydra job dir; the end is a summary table.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field

from xtrain.launcher.fleet import Job, NoticeStop, Preemptions, attempt, check_known, preempted
from xtrain.launcher.jobdir import earlier_attempt
from xtrain.launcher.launch import job_name, say
from xtrain.launcher.runner import LaunchError, VmUnavailable, parallel
from xtrain.launcher.ssh import Ssh
from xtrain.launcher.vm import DISK_KEPT, NO_ANSWER, UP, Vm, VmLost, clock, vm_health
from xtrain.launcher.targets import node_targets
from xtrain.launcher.worker import Worker


@dataclass
class Outcome:
    """How one job of the pool ended: its result (final metrics) or its error."""

    vm: str | None = None  # the VM it last ran on
    result: dict | None = None
    error: BaseException | None = None
    history: Preemptions = field(default_factory=Preemptions)

    @property
    def state(self) -> str:
        if self.error is not None or self.result is None:
            return "failed"
        return "stopped" if self.result.get("preempted") else "finished"


class JobQueue:
    """The jobs not yet run, in order; a requeued job goes first. Thread-safe."""

    def __init__(self, count: int, placed: dict[int, str], vms: int):
        self.pending = deque(range(count))
        self.placed = dict(placed)  # job -> the VM it already runs on (only that VM takes it)
        self.in_flight, self.alive = 0, vms
        self.reasons: list[str] = []  # why each VM that left did
        self.cond = threading.Condition()

    def take(self, vm: str) -> int | None:
        """The next job for ``vm``, a job already on it first (any other would find it busy);
        None once nothing is left to run or to come back."""
        with self.cond:
            while True:
                ready = ([i for i in self.pending if self.placed.get(i) == vm]
                         + [i for i in self.pending if i not in self.placed])
                if ready:
                    i = ready[0]
                    self.pending.remove(i)
                    self.in_flight += 1
                    return i
                if self.drained():
                    return None
                self.cond.wait()

    def drained(self) -> bool:
        """Nothing is left to run or to come back."""
        with self.cond:
            return not self.pending and not self.in_flight

    def finish(self, i: int, requeue: bool = False, stay_on: str | None = None) -> None:
        """Job ``i`` is done with its VM, or back in the queue with ``requeue``; ``stay_on``: the
        VM it stays placed on (which still holds its run or checkpoints), else any VM may take
        it."""
        with self.cond:
            self.in_flight -= 1
            if stay_on:
                self.placed[i] = stay_on
            else:
                self.placed.pop(i, None)
            if requeue:
                self.pending.appendleft(i)
            self.cond.notify_all()

    def leave(self, vm: str, reason: str = "", up: bool = False) -> tuple[list[int], list[int]]:
        """``vm`` leaves the pool (``reason`` is kept in ``reasons``); returns (the jobs placed on
        it that no other VM may run, as it leaves ``up``: running there, or with their
        checkpoints on its disk; the jobs nobody is left to run, as it was the last). Leaving
        down (preempted), its disk goes and the jobs placed on it may run anywhere."""
        with self.cond:
            self.alive -= 1
            self.reasons.append(reason or vm)
            mine = [i for i, v in self.placed.items() if v == vm]
            self.placed = {i: v for i, v in self.placed.items() if v != vm}
            stranded = [i for i in self.pending if i in mine] if up else []
            for i in stranded:
                self.pending.remove(i)
            orphans = list(self.pending) if self.alive == 0 else []
            if orphans:
                self.pending.clear()
            self.cond.notify_all()
            return stranded, orphans


def run_pool(jobs: list[Job], log=say) -> list[Outcome]:
    """Run ``jobs`` over the pool of the first job's launcher fields; one Outcome per job."""
    cfg, hardware = jobs[0].cfg, jobs[0].hardware
    vms = [Vm(name, cfg, hardware, log=_prefixed(log, name)) for name in cfg.pool]
    for vm in vms:  # every refusal before any VM is touched
        check_known(vm, cfg.recreate)
    queue = JobQueue(len(jobs), locate(vms, jobs, log), len(vms))
    outcomes = [Outcome() for _ in jobs]
    threads = [threading.Thread(target=serve, args=(vm, jobs, queue, outcomes),
                                name=f"xtrain-pool-{vm.name}", daemon=True) for vm in vms]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return outcomes


def serve(vm: Vm, jobs: list[Job], queue: JobQueue, outcomes: list[Outcome]) -> None:
    """One VM's thread: run the next job until none is left. The VM leaves the pool when it is
    lost for good (preempted without ``recreate``, or its recreation failed), or when it refuses
    a job before starting it (VmUnavailable): that job goes back to the queue for another VM."""
    while (i := queue.take(vm.name)) is not None:
        job, out = jobs[i], outcomes[i]
        ran_on, out.vm = out.vm, vm.name
        placed_here = queue.placed.get(i) == vm.name  # its run, or checkpoints, are on this VM
        noticed = False  # the job stopped for a GCE notice on this VM, which stayed up
        try:
            state = vm.answer()  # no answer: launched; a launch gcloud fails asks again (attempt)
            if state == NO_ANSWER or vm_health(state, vm.cfg.queued) == UP:
                out.result, out.error = attempt(vm, job, out.history, vm.log), None
                queue.finish(i)
                continue
            # down while idle: the job lost nothing, it waits (for this VM, if it keeps its disk)
            keeps_disk = state in DISK_KEPT
            queue.finish(i, requeue=True, stay_on=vm.name if placed_here and keeps_disk else None)
            why = f"it is {state}"
        except VmLost as lost:  # a NoticeStop too: the job goes back to the queue
            why, noticed = f"it {lost.why}", isinstance(lost, NoticeStop)
            keeps_disk = noticed or lost.state in DISK_KEPT
            # (checkpoints on the VM mean no recreate: fleet.check_recreate wants gs://)
            if noticed and job.checkpoints_on_vm:  # elsewhere it would train from step 0 again
                out.result = lost.result
                vm.log(f"fleet: {lost}: job {job.run_name} stopped for its notice, and its "
                       "checkpoints are on this VM's disk: run the same command to resume it here")
                queue.finish(i)
            else:  # (its checkpoints on a VM that keeps its disk: it waits for that one)
                tied = keeps_disk and job.checkpoints_on_vm
                queue.finish(i, requeue=_survives(vm, job, out, lost),
                             stay_on=vm.name if tied else None)
        except VmUnavailable as e:  # not the job's failure: recreating would not help either
            out.vm = ran_on  # it never ran here
            queue.finish(i, requeue=True, stay_on=vm.name if placed_here else None)
            _leave(vm, jobs, queue, outcomes, f"it refused job {job.run_name} before starting "
                                              f"it: {e}", up=True)
            return
        except Exception as e:  # noqa: BLE001  (the job's own failure, the VM is READY: go on)
            out.error = e
            queue.finish(i)
            continue
        if vm.cfg.recreate:
            if noticed:  # its job is back in the queue, for another VM meanwhile
                vm.wait_out_maintenance(job.notice_lead_s, needed=lambda: not queue.drained())
            why = _restore(vm, out.history)
            if why is None:
                continue
        # (a VM that comes back by itself, under maintenance say, keeps its disk: left up)
        _leave(vm, jobs, queue, outcomes, why, up=keeps_disk and not vm.cfg.recreate)
        return


def _leave(vm: Vm, jobs: list[Job], queue: JobQueue, outcomes: list[Outcome], why: str,
           up: bool = False) -> None:
    """Say once that ``vm`` leaves the pool, and why. Leaving ``up`` (a notice, a refusal), the
    jobs placed on it fail, naming it: on another VM they would train from step 0 (or run twice);
    if it was the last, the jobs not run fail with every VM's reason."""
    vm.log(f"fleet: {vm} leaves the pool: {why}")
    stranded, orphans = queue.leave(vm.name, f"{vm}: {why}", up)
    for i in stranded:
        outcomes[i].error = LaunchError(
            f"job {jobs[i].run_name}: not run: it runs on {vm}, or its checkpoints are on that "
            f"VM's disk, and {vm} left the pool ({why}): run the same command once it takes jobs")
    for orphan in orphans:
        outcomes[orphan].error = LaunchError(f"job {jobs[orphan].run_name}: no VM of the pool is "
                                             "left to run it: " + "; ".join(queue.reasons))


def _survives(vm: Vm, job: Job, out: Outcome, lost: VmLost) -> bool:
    """Record the preemption; False (with the error) when the job's budget is spent."""
    try:
        preempted(vm, job, out.history, lost, vm.log)
        return True
    except LaunchError as e:
        out.error = e
        return False


def _restore(vm: Vm, history: Preemptions) -> str | None:
    """Recreate ``vm``: None once it is READY again, else why it could not be."""
    try:
        vm.restore(history.lost_so_far)
        return None
    except LaunchError as e:
        return f"it could not be recreated: {e}"


def locate(vms: list[Vm], jobs: list[Job], log=say) -> dict[int, str]:
    """Where jobs of this sweep must run: job index -> VM name. A job already on a VM of the pool
    (an earlier launch of the same command), running or ended unwatched, is reattached there. A
    job that ran on a VM before (finished, failed, stopped) with its checkpoints on that VM's disk
    goes back to it: elsewhere it would train from step 0 again (a longer ``trainer.max_steps``,
    ``mode=eval`` and the like share the job's dir and checkpoints); on several VMs, to the one
    its latest attempt (``launch.json``) ran on, else (said) the first in the pool's order. One
    probe per READY VM."""
    index = {job_name(j.run_name): i for i, j in enumerate(jobs)}
    cfg, hardware = jobs[0].cfg, jobs[0].hardware

    def found_on(vm: Vm) -> tuple[list[str], dict[str, str]]:
        """(the jobs on it now, the jobs that ran on it before: name -> their latest attempt)"""
        node = vm.describe()
        if node is None or vm.health() != UP:
            return [], {}
        target = node_targets(node, cfg.address, hardware)[0]
        worker = Worker(target, Ssh(cfg, vm.runner, vm.log), cfg.remote_dir, cfg.venv)
        own = job_name(jobs[0].run_name)  # the probe reports it apart from the others
        try:
            probe = worker.probe(own)
        except LaunchError:  # unreachable, missing tools: refused again when serving, it leaves
            return [], {}
        now = [b.split()[0] for b in probe.busy] + probe.ended
        on_it = probe.job.state == "running" or probe.job.unreported_end
        before = dict(r.split(" ", 1) for r in probe.ran)
        if probe.job.state != "none":
            before[own] = probe.job.attempt or "-"
        return now + ([own] if on_it else []), before

    found = list(zip(vms, parallel(found_on, vms)))
    placed = {}
    for vm, (now, _) in found:
        for i in (index[name] for name in now if name in index):
            placed[i] = vm.name
            log(f"fleet: job {jobs[i].run_name} is already on {vm} (running, or ended "
                "unwatched): reattaching there")
    for i, job in enumerate(jobs):
        if i in placed or not job.checkpoints_on_vm:
            continue
        ran = [(vm, before[job_name(job.run_name)]) for vm, (_, before) in found
               if job_name(job.run_name) in before]
        latest = (earlier_attempt(job.job_dir) or {}).get("attempt")
        vm = next((vm for vm, attempt in ran if attempt == latest), ran[0][0] if ran else None)
        if len(ran) > 1 and latest not in [attempt for _, attempt in ran]:
            log(f"fleet: job {job.run_name} ran on {', '.join(str(v) for v, _ in ran)}, none of "
                f"them its latest attempt ({latest or 'not recorded here'}): the first is taken")
        if vm is not None:
            placed[i] = vm.name
            log(f"fleet: job {job.run_name} ran on {vm} before, and its checkpoints are on that "
                "VM's disk: it runs there again")
    return placed


def _prefixed(log, name: str):
    return lambda message: log(f"[{name}] {message}")


def summary(rows) -> str:
    """The sweep's table: rows of (job, VM, final metrics or None, state, preemptions, seconds
    lost)."""
    table = [("job", "VM", "final loss", "state", "preemptions", "time lost")]
    for name, vm, result, state, count, lost in rows:
        loss = result.get("loss") if result else None
        table.append((name, vm or "-", f"{loss:.4f}" if loss is not None else "-", state,
                      str(count), clock(lost)))
    widths = [max(len(r[c]) for r in table) for c in range(len(table[0]))]
    return "\n".join("  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in table)


def outcome_rows(jobs: list[Job], outcomes: list[Outcome]):
    return [(j.run_name, o.vm, o.result, o.state, o.history.count, o.history.time_lost_s)
            for j, o in zip(jobs, outcomes)]
