"""The record Hydra writes into a job's run dir (``config.yaml``, ``hydra.yaml``,
``overrides.yaml``): where, and when a training's record replaces the one already there.

A training run's dir is shared by every command that trains (or resumes) that run, so its
``.hydra/`` says what trained there last. Hydra writes a job's record before xtrain sees its
config, so a training writes to ``.hydra-pending/``. A command that takes the run holds its own
record aside at once (:func:`hold`, into ``.hydra-held-<id>/``: another command's pending record
is never taken for it) and :func:`accept` makes it ``.hydra/`` once every check has passed:
- a training, once it holds the run dir's lock (xtrain/modes.py), and accepts just before
  training starts (xtrain/train/run.py), which then logs :data:`ACCEPTED`;
- a launch, once its checks here passed (xtrain/launcher/hydra_jobs.py); it accepts when worker
  0 logs that line (xtrain/launcher/launch.py), since the checks of paths and checkpoints run
  there. A launch interrupted (Ctrl-C), or whose job stopped (exit 143), before then leaves its
  record held until the same command reattaches; an acceptance that failed (the launch warns
  and goes on) leaves what it did not move held until a command is accepted there.
A refused command (``checkpoint.keep_last=0``, or a model that differs from the run's checkpoint)
never replaces the record of what trained. A command that took the run and then stops on an
error (a refusal, a launch's unreachable or failed workers, a crash) gives its record back
(:func:`release`): :func:`discard` removes a refused single run's; a launched sweep job's, or a
crashed command's, stays pending. Only the first process of a run writes a record. Other modes
write ``.hydra-<mode>/`` (``mode=sample`` or ``mode=plan`` in a training run's dir leave its
record alone). A command that keeps nothing in its run dir (one refused by the checks of its
config, ``mode=plan``, ``mode=compile``) removes the record Hydra wrote for it (:func:`discard`),
and the run dir if Hydra made it (a single run's dir that was there before stays) and that leaves
it empty (and ``outputs/``, if the command made it and leaves it empty).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import threading
from pathlib import Path

from hydra.experimental.callback import Callback

RECORD = ".hydra"
SWEEP_RECORD = "multirun.yaml"  # Hydra's record of a sweep, in its dir
PENDING = ".hydra-pending"  # where Hydra writes a training's (xtrain/config/__init__.py hydra_subdir)
HELD = ".hydra-held-"  # + an id: a command's, from when it took the run until accepted
ACCEPTED = "every check passed: .hydra/ now records this command"  # a log line, and a marker
# A launch accepts in the thread that streams worker 0's log while its main thread may release:
# one or the other takes the held record whole.
_MOVING = threading.Lock()
# Records this process began to accept: never released, even when the accept failed part-way
# (its command passed its checks; what did not move stays held, as a detached launch's does).
_ACCEPTING: set[tuple[str, str]] = set()


def writes_record(env=os.environ) -> bool:
    """Whether this process writes the Hydra record: the first of a run (RANK 0, or none set, as
    torchrun and xtrain's launchers set it); the others may share its run dir. A RANK that is not
    a number is not the first's (a training refuses it: xtrain/modes.py check_environment)."""
    rank = env.get("RANK", "")
    return rank == "" or (rank.isascii() and rank.isdigit() and int(rank) == 0)


def accept(run_dir: str, held: str) -> None:
    """The record ``held`` (:func:`hold`) becomes the run dir's record (each file replaced in one
    rename). A file already moved (by a launch reattached twice) is no error. Records held by
    commands never accepted (launches interrupted or stopped, then reattached) go with it."""
    pending = Path(run_dir) / held
    with _MOVING:
        _ACCEPTING.add((str(run_dir), held))
        if not pending.is_dir():
            return
        record = Path(run_dir) / RECORD
        record.mkdir(exist_ok=True)
        for path in pending.iterdir():
            with contextlib.suppress(FileNotFoundError):
                os.replace(path, record / path.name)
        with contextlib.suppress(OSError):
            pending.rmdir()
    for stale in Path(run_dir).glob(HELD + "*"):
        shutil.rmtree(stale, ignore_errors=True)


def hold(run_dir: str) -> str | None:
    """Move the pending record aside for the command that took the run (see the module's doc);
    returns its directory's name in ``run_dir`` (for :func:`accept`), None when there is none
    (other modes, other processes than the first)."""
    held = HELD + secrets.token_hex(4)
    try:
        os.rename(Path(run_dir) / PENDING, Path(run_dir) / held)
    except FileNotFoundError:
        return None
    return held


@contextlib.contextmanager
def released_on_error(*records: tuple[str, str | None]):
    """An error raised in the body (a refusal, a failed launch, a crash) :func:`release`-s the
    ``(run_dir, held)`` records not accepted by then."""
    try:
        yield
    except Exception:
        for run_dir, held in records:
            release(run_dir, held)
        raise


def release(run_dir: str, held: str | None) -> None:
    """A command refused or failed after :func:`hold` gives its record back as the pending one,
    where :func:`discard` removes it; when another command's pending record is there meanwhile,
    this one is removed here. A record already accepted, or whose acceptance failed, is not
    touched."""
    if held is None:
        return
    with _MOVING:
        if (str(run_dir), held) in _ACCEPTING:
            return
        try:
            os.rename(Path(run_dir) / held, Path(run_dir) / PENDING)
        except FileNotFoundError:  # accepted (or never held)
            return
        except OSError:  # another command's pending record (a non-empty dir) is not replaced
            shutil.rmtree(Path(run_dir) / held, ignore_errors=True)


HYDRA_FILES = ("config.yaml", "hydra.yaml", "overrides.yaml")  # what Hydra writes in a record
_RUN_DIR_FOUND: list[str] = []  # this single run's dir, when it was there before Hydra's mkdir


class RunDirWatch(Callback):
    """[hydra-core] conf/train.yaml's Hydra callback: notes a single run's dir that was already
    there (an empty dir named by ``hydra.run.dir``), so that :func:`discard` leaves it. Hydra
    makes the dir (``exist_ok``) in the same call that runs the job, so only a callback sees it
    before."""

    def on_run_start(self, config, **kwargs) -> None:
        from hydra.core.hydra_config import HydraConfig
        from omegaconf import OmegaConf

        _RUN_DIR_FOUND.clear()
        hydra_config = HydraConfig.instance()
        before = hydra_config.cfg
        hydra_config.set_config(config)  # the run's name resolves from it, as in Hydra's run_job
        try:
            run_dir = OmegaConf.select(config, "hydra.run.dir")
        except Exception:  # noqa: BLE001  (refused as Hydra reads it next, where it is reported)
            return
        finally:
            hydra_config.cfg = before
        if run_dir and os.path.isdir(run_dir):
            _RUN_DIR_FOUND.append(os.path.abspath(run_dir))


def discard(run_dir: str, cwd_before: set[str] | None = None) -> None:
    """Remove the record Hydra wrote in ``run_dir`` for this command, and ``run_dir`` if that
    leaves it empty, and its parents in the working dir that leaves empty if they are under an
    entry the working dir did not have before the command (``cwd_before``: Hydra made them,
    as conf/train.yaml's ``outputs/``); a single run's dir that was there before the command
    (:class:`RunDirWatch`) stays, and so do its parents. Only Hydra's files go, only from a record of xtrain's naming (not a
    ``hydra.output_subdir`` set by hand), still where Hydra wrote it and naming this command's
    overrides as written: one held (:func:`hold`), or written meanwhile by another command, stays.
    A process other than the first writes no record: the dirs alone go, when empty."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return
    records = ()
    if writes_record():
        record = _own_record(run_dir, HydraConfig.get())
        if record is None:
            return
        for file in HYDRA_FILES:
            with contextlib.suppress(FileNotFoundError):
                (record / file).unlink()
        records = (record,)
    cwd = Path.cwd()
    parents = [p for p in Path(run_dir).absolute().parents if cwd_before is not None
               and p.is_relative_to(cwd) and p != cwd and p.relative_to(cwd).parts[0] not in cwd_before]
    found = os.path.abspath(run_dir) in _RUN_DIR_FOUND  # not Hydra's: it stays, and its parents
    for directory in records if found else (*records, Path(run_dir), *parents):
        with contextlib.suppress(OSError):
            directory.rmdir()


def _own_record(run_dir: str, hc) -> Path | None:
    """The record Hydra wrote in ``run_dir`` for this command, if it is xtrain's (named so, not a
    ``hydra.output_subdir`` set by hand) and names this command's overrides as written."""
    from omegaconf import OmegaConf

    name = hc.output_subdir
    if name != PENDING and not (isinstance(name, str) and name.startswith(RECORD + "-") and "/" not in name):
        return None
    record = Path(run_dir) / name
    try:
        written = OmegaConf.to_container(OmegaConf.load(record / "overrides.yaml"))
    except Exception:  # noqa: BLE001  (none, or unreadable: not a record to remove)
        return None
    if written != OmegaConf.to_container(hc.overrides.task):  # unresolved, as Hydra wrote them
        return None
    return record
