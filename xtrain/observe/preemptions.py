"""What a job re-run after a preemption knows about the preemptions before it, and what a job
that stopped tells the launcher about why.

The launcher (xtrain/launcher/fleet.py) sets these variables in the re-run's environment; the
metrics callback (xtrain/observe/metrics.py) writes them once, as a record at the step training
resumes from, to every sink (metrics.jsonl, W&B), so the run's own metrics show what it survived.
Variables rather than config fields: they describe this launch, not what is trained, and must not
change the run's config or name.

A run that stops before its end (exit 143) writes a ``stop`` record (:func:`stop_record`, from
xtrain/train/run.py) saying whether a GCE notice or a signal stopped it; the launcher folds rank
0's metrics.jsonl into the job's result (xtrain/launcher/launch.py ``result``), and the fleet
judges the stop by it: a notice's stop is the VM's, a signal's may be the job's own.
"""

from __future__ import annotations

import os

PREEMPTIONS = "XTRAIN_PREEMPTIONS"  # preemptions of the job's VM(s) so far
TIME_LOST = "XTRAIN_TIME_LOST_S"  # seconds from each preemption seen to the re-run's launch, summed
STEPS_SEEN = "XTRAIN_STEPS_SEEN"  # the furthest step logged before the latest preemption
# the launcher's id of this start of the job: a stop record from an earlier start (metrics.jsonl
# outlives it) is not this one's
ATTEMPT = "XTRAIN_ATTEMPT"
# what stopped a run (xtrain/train/preemption.py): SIGTERM/SIGINT, or a GCE notice from the
# metadata server (xtrain/train/notices.py), on any of its processes
SIGNAL, NOTICE = "signal", "notice"


def launch_env(preemptions: int, time_lost_s: float, steps_seen: int | None) -> dict[str, str]:
    env = {PREEMPTIONS: str(preemptions), TIME_LOST: f"{time_lost_s:.1f}"}
    if steps_seen is not None:
        env[STEPS_SEEN] = str(steps_seen)
    return env


def record(step: int, environ=os.environ) -> dict | None:
    """The record of a re-run starting at ``step`` (None for a first run): ``preemptions``,
    ``time_lost_s`` and ``steps_redone``, the logged steps of the latest preempted attempt that
    lie beyond the checkpoint resumed from (done twice)."""
    if PREEMPTIONS not in environ:
        return None
    out = {"step": step, "preemptions": int(environ[PREEMPTIONS]),
           "time_lost_s": float(environ.get(TIME_LOST, 0))}
    if STEPS_SEEN in environ:
        out["steps_redone"] = max(0, int(environ[STEPS_SEEN]) - step)
    return out


def stop_record(stopped_for: str, reason: str | None, environ=os.environ) -> dict:
    """The values of a stopped run's ``stop`` record: ``stopped_for`` (SIGNAL or NOTICE),
    ``stop_reason`` (the signal's name or the notice, when this process was the one told: on
    several processes it may have been another) and the launcher's ``attempt``, when launched."""
    out = {"stopped_for": stopped_for}
    if reason:
        out["stop_reason"] = reason
    if ATTEMPT in environ:
        out["attempt"] = environ[ATTEMPT]
    return out
