"""The local job dir of a launched job (the Hydra job dir on the launching machine): what it keeps
of the job's attempts, and what it tells a later launch of the same command.

    launch.json    the latest attempt: its id, the workers' addresses, the remote job and run dirs
    worker-<i>.log the copy of worker i's log of the latest attempt (worker-<i>.preempted-<n>.log:
                   of the attempts a preemption ended, xtrain/launcher/logs.py kept_aside)
    metrics.jsonl  the copy of rank 0's metrics.jsonl, every attempt's records
    wandb-run-id   the job's W&B run id (xtrain/observe/wandb_run.py run_id)
"""

from __future__ import annotations

import json
import os

from xtrain.launcher.logs import furthest_logged_step, log_path
from xtrain.naming import names_checkpoint
from xtrain.observe.wandb_run import RUN_ID_ENV, run_id
from xtrain.paths import is_local, write_whole

LAUNCH_RECORD = "launch.json"


def record_attempt(job_dir: str, job_id: str, attempt: str, workers, remote_job_dir: str,
                   remote_run_dir: str) -> None:
    record = {"job": job_id, "attempt": attempt, "hosts": [w.host for w in workers],
              "remote_job_dir": remote_job_dir, "remote_run_dir": remote_run_dir}
    # replaced whole: a launch killed here leaves the old one
    write_whole(os.path.join(job_dir, LAUNCH_RECORD), json.dumps(record, indent=1).encode())


def earlier_attempt(job_dir: str) -> dict | None:
    """The latest attempt ``launch.json`` records, if any (one unreadable counts as none)."""
    try:
        with open(os.path.join(job_dir, LAUNCH_RECORD)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def identity_env(job_dir: str, probes, checkpoint_dir: str | None, overrides,
                 log) -> dict[str, str]:
    """The variables naming the job itself on its workers (its W&B run id). A job that ran before
    (``launch.json``) on workers that now hold no trace of it (a recreated VM's new disk, another
    VM of a pool) is said to be starting over unless its checkpoints are remote (or it starts from
    a checkpoint its ``overrides`` name): the job itself cannot tell a first start from one
    whose checkpoints went with a VM. With them in the run dir on the VM (``checkpoint_dir`` None,
    the default), it trains from step 0 again, as a new W&B run: the old one's steps are ahead of
    it, and W&B drops steps logged out of order."""
    before = earlier_attempt(job_dir)
    traceless = all(p.job.state == "none" and p.job.attempt is None and p.job.command is None
                    for p in probes)  # (a start that failed leaves its attempt and command)
    remote = not is_local(checkpoint_dir or "")
    if not (before and traceless) or remote or names_checkpoint(overrides):
        return {RUN_ID_ENV: run_id(job_dir, environ={})}
    step = furthest_logged_step(job_dir)
    ran = (f"launch: warning: job {before['job']} ran before on {before['hosts'][0]} (attempt "
           f"{before['attempt']}{f', step {step} logged' if step is not None else ''}), and these "
           "workers hold no trace of it (a new VM's disk?)")
    advice = "checkpoint.dir=gs://... keeps checkpoints across VMs"
    if checkpoint_dir is None:
        log(f"{ran}: its checkpoints were in the run dir on that VM, so it trains from step 0 "
            f"again, as a new W&B run; {advice}")
        return {RUN_ID_ENV: run_id(job_dir, environ={}, renew=True)}
    log(f"{ran}: unless checkpoint.dir={checkpoint_dir} is on a disk that outlived that VM, it "
        f"trains from step 0 again; {advice}")
    return {RUN_ID_ENV: run_id(job_dir, environ={})}


def resume_offset(job_dir: str, index: int, attempt: str, remote_bytes: int) -> int:
    """Bytes of the worker's log already in the local copy, when that copy is of this attempt;
    otherwise the local copy is started again (a new attempt, or a copy from another attempt)."""
    path, marker = log_path(job_dir, index), log_path(job_dir, index) + ".attempt"
    have = os.path.getsize(path) if os.path.exists(path) else 0
    same = os.path.exists(marker) and open(marker).read().strip() == attempt
    if same and have <= remote_bytes:
        return have
    open(path, "wb").close()
    with open(marker, "w") as f:
        f.write(attempt + "\n")
    return 0


def keep_metrics(path: str, remote: str) -> None:
    """The job dir's copy of rank 0's metrics.jsonl. The remote file only grows while its run dir
    lasts; one that does not continue the copy's part from it is a new run dir (a VM recreated
    after a preemption): it is appended to the copy, so the copy keeps the earlier attempts'
    records (plots and xtrain.report read the last attempt's records of steps logged twice).
    ``<path>.from`` holds where the current run dir's part of the copy begins."""
    have = open(path).read() if os.path.exists(path) else ""
    start = int(open(path + ".from").read()) if os.path.exists(path + ".from") else 0
    start = start if start <= len(have) else 0  # the copy itself was replaced
    if not remote.startswith(have[start:]):
        have += "\n" if have and not have.endswith("\n") else ""
        start = len(have)
    with open(path + ".from", "w") as f:
        f.write(str(start))
    with open(path, "w") as f:
        f.write(have[:start] + remote)
