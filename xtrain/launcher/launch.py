"""One job on its workers, end to end.

1. Local checks, then the targets (explicit hosts or gcloud), then one probe per worker: every
   refusal (a missing key, a host count that is not the profile's, a changed host key, a busy
   worker) comes before anything is copied.
2. If the job is already there (running, or ended unwatched), reattach. Otherwise, on every worker
   in parallel: sync the code, make the environment match, then start the job detached, with the
   worker index and the coordinator in its environment and the secrets over stdin.
3. Follow every worker's log; when one fails, stop the others and report the first failure with
   the tail of its log; a dropped stream is reattached; at the end, return the final metrics.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import queue
import re
import secrets as random_tokens
import shlex
import time

from xtrain.config.hydra_record import ACCEPTED, accept
from xtrain.errors import EXIT_STOPPED, ConfigError
from xtrain.launcher import secrets as job_secrets
from xtrain.launcher.env import EnvSpec, ensure_env, requirements
from xtrain.launcher.gcloud import Gcloud
from xtrain.launcher.job import JobState, RemoteJob, command_digest, stop_others
from xtrain.launcher.jobdir import identity_env, keep_metrics, record_attempt, resume_offset
from xtrain.launcher.logs import LogStream, log_path, tail_lines
from xtrain.launcher.runner import LaunchError, Runner, VmUnavailable, parallel
from xtrain.launcher.ssh import Ssh
from xtrain.launcher.sync import code_files, code_record, send_code_record, source_root, sync
from xtrain.launcher.targets import resolve_targets
from xtrain.launcher.worker import Worker, launch_lock
from xtrain.observe.plots import parse_records
from xtrain.observe.preemptions import ATTEMPT, NOTICE

STREAM_LIVED_S = 60.0  # a log stream that lived this long (or brought lines) was working


def say(message: str) -> None:
    print(message, flush=True)


def launch_job(cfg, hardware, overrides, run_name: str, job_dir: str, runner: Runner | None = None,
               log=say, vm_check=None, record: str | None = None,
               checkpoint_dir: str | None = None) -> dict:
    """Run ``python -m xtrain <overrides>`` on the workers ``cfg`` names; returns the final metrics
    (and ``preempted``, with the run's ``stopped_for``, or ``stopped`` when the job did not
    finish). Raises ConfigError for bad input, LaunchError when a worker fails or cannot be
    reached. ``vm_check`` (xtrain/launcher/vm.py, Vm.check) is called whenever a worker's log
    stream ends and raises when the VM itself is gone. A refusal before the job started is a
    VmUnavailable. ``record``: where ``job_dir`` holds this command's .hydra record
    (xtrain/config/hydra_record.py hold), accepted once worker 0 logs that its checks passed.
    ``checkpoint_dir``: the job's checkpoint.dir (None: the run dir on its workers)."""
    t0 = time.perf_counter()
    runner = runner or Runner()
    ssh = Ssh(cfg, runner, log)
    ssh.check_local()
    job_id = job_name(run_name)
    if cfg.stop:  # on every worker that answers, whatever state this checkout is in
        os.makedirs(job_dir, exist_ok=True)
        return stop_job(workers_of(cfg, hardware, ssh, runner), job_id, cfg.stop_grace_s,
                        cfg.lock_wait_s, log)
    secret_values = job_secrets.collect(cfg.secrets)
    root = source_root(cfg.source)
    files = code_files(root, runner, cfg.exclude, cfg.max_file_mb, cfg.max_total_mb)
    spec = EnvSpec(cfg.base_python or f"python{hardware.python}",
                   tuple(requirements(root, hardware.pins)), tuple(cfg.pip_args), cfg.install)
    workers = workers_of(cfg, hardware, ssh, runner)
    os.makedirs(job_dir, exist_ok=True)
    code = code_record(root, files)
    with before_start():
        parallel(lambda w: w.probe(job_id), workers)  # reaches them, knows their dirs
    # no other launch places a job in between
    with launch_lock(workers, log, cfg.lock_wait_s) as still_held:
        with before_start():
            probes = parallel(lambda w: w.probe(job_id), workers)
        jobs = [RemoteJob(w, job_id) for w in workers]
        if reattachable(jobs, probes, overrides, run_name, log):  # whatever else runs there
            attempt = next(p.job.attempt for p in probes if p.job.attempt)
            log(f"launch: job {job_id} (attempt {attempt}) is already on the workers: reattaching")
            offsets = [resume_offset(job_dir, w.index, attempt, p.job.log_bytes)
                       for w, p in zip(workers, probes)]
        else:
            busy = [f"{w}: {b}" for w, p in zip(workers, probes) for b in p.busy]
            if busy:
                raise VmUnavailable("another xtrain job is running there: " + "; ".join(busy) +
                                    " (stop it with its own command plus hydra.launcher.stop=true)")
            prepare_all(workers, probes, root, files, code, spec, log)
            still_held()
            # not before_start: a start cut short may have left the job running (job.start raises
            # VmUnavailable itself where the worker refused it)
            attempt = start_fresh(cfg, hardware, jobs, overrides, run_name, secret_values, log,
                                  identity_env(job_dir, probes, checkpoint_dir, overrides, log))
            log(f"launch: started {job_id} (attempt {attempt}) on {len(jobs)} worker(s) "
                f"{time.perf_counter() - t0:.1f} s after launch; watch: tail -f "
                f"{log_path(job_dir, 0)}")
            offsets = [resume_offset(job_dir, w.index, attempt, 0) for w in workers]
    record_attempt(job_dir, job_id, attempt, workers, jobs[0].dir, run_dir(workers[0], job_id))
    watch = accepting(job_dir, record, log, seen=offsets[0])
    states = follow(jobs, job_dir, offsets, cfg, log, vm_check, watch)
    return result(workers[0], job_id, job_dir, states, log, attempt)


def workers_of(cfg, hardware, ssh: Ssh, runner: Runner) -> list[Worker]:
    """The workers of the VMs or hosts ``cfg`` names (gcloud describes a TPU VM's)."""
    return [Worker(t, ssh, cfg.remote_dir, cfg.venv)
            for t in resolve_targets(cfg, hardware, Gcloud(runner))]


def accepting(job_dir: str, record: str | None, log, seen: int = 0):
    """Worker 0's log lines are given to this: at its line saying that every check passed (the
    checks of paths and checkpoints run there), the held ``record`` becomes ``job_dir``'s record.
    The first ``seen`` bytes of the local copy of that log (a reattached job's) are read now."""
    def on_line(text: str) -> None:
        if record and text.rsplit("\r", 1)[-1].strip() == ACCEPTED:
            try:
                accept(job_dir, record)
            except OSError as e:  # the job goes on; its stream must too
                log(f"launch: warning: {job_dir}/.hydra not updated ({e})")

    if record and seen:
        with open(log_path(job_dir, 0), "rb") as f:
            for line in f.read(seen).decode(errors="replace").splitlines():
                on_line(line)
    return on_line


def reattachable(jobs, probes, overrides, run_name: str, log) -> bool:
    """Whether the job is on the workers (running, or ended unwatched) with this very command, to
    be followed instead of started. The run name leaves out what does not change the training
    (``mode``, ``trainer.max_steps``...), so another command may hold the same job dir: running,
    it is refused; ended, its end is marked seen and this command starts afresh."""
    if not any(p.job.state == "running" or p.job.unreported_end for p in probes):
        return False
    other = [j.worker for j, p in zip(jobs, probes) if p.job.command not in (
        None, command_digest(remote_command(j.worker, overrides, run_name, j.job_id)))]
    if not other:
        return True
    if any(p.job.state == "running" for p in probes):
        raise ConfigError(
            f"job {jobs[0].job_id} is running on {other[0]} with other overrides than these (its "
            f"command: {jobs[0].dir}/run.sh there): stop it first (hydra.launcher.stop=true, with "
            "overrides that give the same run name), or give this job a run.name of its own")
    log(f"launch: job {jobs[0].job_id} ended unwatched on the workers with other overrides; its "
        "end is marked seen and this command starts afresh")
    parallel(lambda j: j.acknowledge(), jobs)
    return False


@contextlib.contextmanager
def before_start():
    """A LaunchError raised inside left nothing of the job running: raised as VmUnavailable."""
    try:
        yield
    except LaunchError as e:
        raise VmUnavailable(str(e)) from e


def job_name(run_name: str) -> str:
    """A directory name for the run (its remote job and run dirs), stable across launches."""
    safe = re.sub(r"[^A-Za-z0-9._-]+", "_", run_name).strip("._") or "job"
    if safe != run_name or len(safe) > 80:
        safe = f"{safe[:80]}-{hashlib.sha256(run_name.encode()).hexdigest()[:8]}"  # stay distinct
    return safe


def start_fresh(cfg, hardware, jobs, overrides, run_name: str, secret_values, log,
                job_identity_env: dict[str, str]) -> str:
    """Start a new attempt of the job on every worker; returns its id. ``job_identity_env``:
    variables naming the job itself, kept in the local job dir (the W&B run id). If one worker
    cannot start, those that did are stopped (a pod's workers would wait for the missing one)
    and marked seen, so the next launch starts afresh; the error is raised."""
    attempt = time.strftime("%Y%m%d-%H%M%S-") + random_tokens.token_hex(3)
    workers = [j.worker for j in jobs]
    commands = [remote_command(w, overrides, run_name, jobs[0].job_id) for w in workers]
    log("launch: starting on every worker; worker 0 runs: " + shlex.join(commands[0]))
    lockfile = cfg.tpu_lockfile if hardware.accelerator_type else None

    def start(job):
        try:
            return job.start(commands[job.worker.index], job.worker.code,
                             {**job_env(cfg, job.worker, workers, attempt), **job_identity_env},
                             secret_values, attempt,
                             cfg.stop_grace_s, lockfile)
        except (LaunchError, OSError) as e:
            return e

    outcomes = parallel(start, jobs)
    errors = [e for e in outcomes if isinstance(e, Exception)]
    if errors:
        started = [j for j, o in zip(jobs, outcomes) if not isinstance(o, Exception)]
        stop_others(started, cfg.stop_grace_s, log, acknowledge=True)
        raise errors[0]
    return attempt


def prepare_all(workers, probes, root, files, code: str, spec, log) -> None:
    """On every worker in parallel: sync the code, make the environment match."""
    with before_start():
        done = parallel(lambda w: prepare(w, root, files, code, spec, probes[w.index]), workers)
    for w, (sent, env_state) in zip(workers, done):
        log(f"launch: {w}: {len(sent)} file(s) synced, environment {env_state}")


def prepare(worker, root, files, code: str, spec, probe) -> tuple[list[str], str]:
    sent = sync(worker.ssh, worker.host, root, files, worker.code)
    send_code_record(worker.ssh, worker.host, worker.code, code)
    return sent, ensure_env(worker, spec, probe.stamp, probe.lacks)


def run_dir(worker, job_id: str) -> str:
    return f"{worker.root}/runs/{job_id}"


def remote_command(worker, overrides, run_name: str, job_id: str) -> list[str]:
    """The job's own overrides (no Hydra or launcher settings: the worker runs it in place), with
    the run name and run dir fixed, so every worker and every relaunch agree on them."""
    kept = [o for o in overrides
            if not o.lstrip("+~").startswith(("hydra.", "hydra/", "run.name="))]
    return [f"{worker.venv}/bin/python", "-u", "-m", "xtrain", *kept,
            f"run.name={hydra_str(run_name)}", f"hydra.run.dir={hydra_str(run_dir(worker, job_id))}"]


def hydra_str(value: str) -> str:
    """A value in Hydra's override grammar, quoted when it holds more than a plain path (a run
    name may hold , [ ] or =)."""
    if re.fullmatch(r"[A-Za-z0-9_./-]+", value):
        return value
    # Hydra reads a backslash literally except in a run before a quote (or the closing one):
    # such a run is doubled, and the quote escaped
    return "'" + re.sub(r"(\\*)('|\Z)", lambda m: 2 * m[1] + ("\\'" if m[2] else ""), value) + "'"


def job_env(cfg, worker, workers, attempt: str) -> dict[str, str]:
    """torch.distributed's standard variables (worker 0 coordinates) plus xtrain's own."""
    return {"XTRAIN_WORKER": str(worker.index), ATTEMPT: attempt, "RANK": str(worker.index),
            "WORLD_SIZE": str(len(workers)), "MASTER_ADDR": workers[0].internal,
            "MASTER_PORT": str(cfg.coordinator_port), "PYTHONUNBUFFERED": "1",
            "PYTHONPYCACHEPREFIX": worker.root + "/pycache",
            **{str(k): str(v) for k, v in cfg.env.items()}}


def follow(jobs, job_dir, offsets, cfg, log, vm_check=None, on_line0=None) -> list[JobState]:
    """Stream every worker's log until every job ended (worker 0's lines also to ``on_line0``);
    on the first failure stop the others (one that no longer answers then is said, not waited
    for). Returns the final states; raises LaunchError with the first failure's log tail.
    Long: one loop over the workers' ends, whose cases share the streams, the count of cuts in
    a row and the first failure."""
    ended: queue.Queue = queue.Queue()
    streams = {}

    def open_stream(i, offset):
        streams[i] = LogStream(jobs[i], log_path(job_dir, i), offset, ended, log,
                               on_line0 if i == 0 else None)
        streams[i].start()

    for job, offset in zip(jobs, offsets):
        open_stream(job.worker.index, offset)
    final: dict[int, JobState | None] = {}  # None: stopped answering after the first failure
    first_failure = None
    cuts, drained = dict.fromkeys(streams, 0), {}  # drained: the end seen before the last lines
    try:
        while len(final) < len(jobs):
            i = ended.get()
            if i in final:
                continue
            if vm_check is not None and i not in drained:
                vm_check()  # a preempted VM raises here, before a poll waits for it over ssh
            state = drained.get(i) or _poll(jobs[i], None if first_failure is None else log)
            if state is None:
                final[i] = None
                continue
            if state.state == "running":  # the connection dropped, not the job
                cuts[i] = 1 if streams[i].worked(STREAM_LIVED_S) else cuts[i] + 1  # in a row
                if cuts[i] > cfg.retries + 3:
                    raise LaunchError(f"{jobs[i].worker}: its log stream keeps dropping; the job "
                                      "continues there: run the same command to reattach")
                log(f"launch: {jobs[i].worker}: log stream cut; the job is still running, "
                    "reattaching")
                time.sleep(min(cfg.backoff_s, 2.0))
                open_stream(i, streams[i].offset)
                continue
            if not streams[i].whole and i not in drained:  # cut before the job's last lines
                drained[i] = state
                open_stream(i, streams[i].offset)
                continue
            final[i] = state
            if state.failed and first_failure is None:
                first_failure = i
                others = [j for j in jobs if j.worker.index not in final]
                if others:
                    log(f"launch: {jobs[i].worker} failed ({state.describe()}); stopping the others")
                    stop_others(others, cfg.stop_grace_s, log)
    except KeyboardInterrupt:
        log("launch: interrupted; the job continues on the workers (run the same command to "
            "reattach, add hydra.launcher.stop=true to stop it)")
        raise
    finally:
        for s in streams.values():
            s.close()
    parallel(lambda j: j.acknowledge(), [j for j in jobs if final[j.worker.index]])
    if first_failure is not None:
        worker = jobs[first_failure].worker
        raise LaunchError(f"{worker} failed ({final[first_failure].describe()}); the last lines of "
                          f"its log ({log_path(job_dir, first_failure)}):\n"
                          + tail_lines(log_path(job_dir, first_failure)))
    return [final[j.worker.index] for j in jobs]


def _poll(job, log=None) -> JobState | None:
    """The job's state. One that cannot be read raises, or with ``log`` (another worker failed
    already, the failure the launch reports) is said, and None."""
    try:
        return job.state()
    except LaunchError as e:
        error = f"{e}; the job may still be running there: run the same command to reattach"
        if log is None:
            raise LaunchError(error) from e
        log(f"launch: {error}")
        return None


def result(worker0, job_id: str, job_dir: str, states, log, attempt: str) -> dict:
    """Final metrics: every metrics.jsonl row of rank 0 folded, later values winning; a ``stop``
    record only from this ``attempt`` (an earlier one's would say why that one stopped)."""
    r = worker0.run(f"cat {shlex.quote(run_dir(worker0, job_id))}/metrics.jsonl 2>/dev/null\n",
                    "metrics")
    keep_metrics(os.path.join(job_dir, "metrics.jsonl"), r.stdout)
    final: dict = {}
    for row in parse_records(r.stdout, f"{worker0}: metrics.jsonl"):
        if row.get("kind") != "stop" or row.get("attempt") == attempt:
            final.update(row)
    final["remote_run_dir"] = run_dir(worker0, job_id)
    if any(s.exit_code == EXIT_STOPPED for s in states):
        final["preempted"] = True
        why = "for a GCE notice" if final.get("stopped_for") == NOTICE else "at a signal"
        log(f"launch: the job stopped {why} (exit 143) after its checkpoint; run the same "
            "command to resume" if "stopped_for" in final else  # this attempt's stop record
            "launch: the job was stopped (exit 143) before this start saved a checkpoint (a "
            "signal while it started up); run the same command to go on from its newest "
            "checkpoint, if it has one")
    with open(os.path.join(job_dir, "result.json"), "w") as f:
        json.dump(final, f, indent=1)
    shown = ", ".join(f"{k} {final[k]}" for k in ("step", "loss", "val_loss") if k in final)
    log(f"launch: job {job_id} ended on every worker: {shown or 'no metrics'}")
    return final


def stop_job(workers, job_id: str, grace_s: float, lock_wait_s: float, log) -> dict:
    """``hydra.launcher.stop=true``: SIGTERM the job where it runs (SIGKILL after the grace) on
    every worker that answers, then raise LaunchError naming those that did not. The launch lock
    of every worker that answers is taken first, all together as a launch takes them: a launch
    placing the job now has started it on all of them by then."""
    def reach(worker):
        try:
            worker.probe(job_id)  # reaches it, knows its dirs
            return None
        except LaunchError as e:  # a pod's host that is gone keeps no other from being stopped
            return e

    def stop_one(worker):
        try:
            if worker.probe(job_id).job.state != "running":
                return "idle"
            job = RemoteJob(worker, job_id)
            killed = job.stop(grace_s)
            job.acknowledge()  # the next launch starts (and resumes) afresh
            return "killed" if killed else "stopped"
        except LaunchError as e:
            return e

    outcomes = parallel(reach, workers)
    answered = [w for w, o in zip(workers, outcomes) if o is None]
    with launch_lock(answered, log, lock_wait_s):
        stops = dict(zip([w.index for w in answered], parallel(stop_one, answered)))
    outcomes = [stops.get(w.index, o) for w, o in zip(workers, outcomes)]
    stopped = [o for o in outcomes if o in ("stopped", "killed")]
    if stopped:
        log(f"launch: stopped job {job_id} on {len(stopped)} worker(s)"
            + (" (killed after the grace period)" if "killed" in outcomes else ""))
    unreached = [f"{w}: {o}" for w, o in zip(workers, outcomes) if isinstance(o, LaunchError)]
    if unreached:
        raise LaunchError(f"job {job_id} could not be stopped where the workers did not answer: "
                          f"{'; '.join(unreached)}; run the same command again to stop it there")
    if not stopped:
        log(f"launch: job {job_id} is not running on any worker")
    return {"stopped": bool(stopped)}
