"""The record Hydra writes into a job's run dir (``config.yaml``, ``hydra.yaml``,
``overrides.yaml``): where, and when a training's record replaces the one already there.

A training run's dir is shared by every command that trains (or resumes) that run, so its
``.hydra/`` says what trained there last. Hydra writes a job's record before xtrain sees its
config, so a training writes to ``.hydra-pending/`` and :func:`accept` moves that into ``.hydra/``
once every check has passed, just before training starts (xtrain/train/run.py), which logs
:data:`ACCEPTED`. A launched job's local record is taken (:func:`hold`) as its launch starts and
accepted (:func:`accept_held`) when its first worker logs that line (xtrain/launcher/launch.py):
the checks of paths and checkpoints run there. A refused command (``checkpoint.keep_last=0``, or a
model that differs from the run's checkpoint) never replaces the record of what trained. Only the
first process of a run writes a record. Other modes write ``.hydra-<mode>/`` (``mode=sample`` or ``mode=plan`` in a
training run's dir leave its record alone).
"""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path

RECORD = ".hydra"
PENDING = ".hydra-pending"  # a training's, until accepted (xtrain/config/__init__.py hydra_subdir)
ACCEPTED = "every check passed: .hydra/ now records this command"  # a log line, and a marker


def writes_record(env=os.environ) -> bool:
    """Whether this process writes the Hydra record: the first of a run (RANK 0, or none set, as
    torchrun and xtrain's launchers set it); the others may share its run dir."""
    return env.get("RANK", "0") in ("", "0")


def accept(run_dir: str) -> None:
    """The pending record of an accepted training becomes the run dir's record (each file
    replaced in one rename). Called by the run's first process only; a file already moved (by
    a process that thought itself first too) is no error."""
    pending = Path(run_dir) / PENDING
    if not pending.is_dir():
        return
    record = Path(run_dir) / RECORD
    record.mkdir(exist_ok=True)
    for path in pending.iterdir():
        with contextlib.suppress(FileNotFoundError):
            os.replace(path, record / path.name)
    with contextlib.suppress(OSError):
        pending.rmdir()


def hold(run_dir: str) -> dict[str, bytes]:
    """The pending record, read and removed: a launched job keeps its own until its workers
    accept it, by when another (refused) command may have written a pending record there."""
    pending = Path(run_dir) / PENDING
    if not pending.is_dir():
        return {}
    files = {path.name: path.read_bytes() for path in pending.iterdir() if path.is_file()}
    shutil.rmtree(pending, ignore_errors=True)
    return files


def accept_held(run_dir: str, files: dict[str, bytes]) -> None:
    """``files`` (from :func:`hold`) become the run dir's record, each replaced in one rename."""
    record = Path(run_dir) / RECORD
    record.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        partial = record / f".{name}.partial"
        partial.write_bytes(data)
        os.replace(partial, record / name)
