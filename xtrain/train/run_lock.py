"""One training at a time in a run dir. Two commands training the same run in the same run dir
(the same command in two terminals) would interleave their metrics.jsonl records, replace each
other's checkpoints step by step and take each other's .hydra record.

The lock is ``flock`` on the run dir itself (no file is added to it), held by the training's first
process until it ends: the kernel drops it when the process ends however it ends (a crash,
SIGKILL), so no stale lock outlives a training. Where the filesystem has no ``flock`` (some
network filesystems, object storage: a ``gs://`` run dir) the run goes on unlocked. Trainings in
other run dirs (other hosts) sharing a ``checkpoint.dir`` are kept apart by its lease
(xtrain/checkpoint/lease.py), held for the whole training as this lock is.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os

from xtrain.errors import ConfigError
from xtrain.paths import is_local


class RunDirInUse(ConfigError):
    """Refused: another process trains in the run dir (whose Hydra record, not yet held, may be
    the same as this command's: xtrain/cli.py leaves it)."""


@contextlib.contextmanager
def run_dir_lock(run_dir: str):
    """Hold the run dir's lock inside the block; refused while another process trains there."""
    if not is_local(run_dir):  # a bucket has no flock (and the URL is no local path to make)
        yield
        return
    os.makedirs(run_dir, exist_ok=True)  # Hydra made it; a caller of xtrain.modes.run may not have
    fd = os.open(run_dir, os.O_RDONLY | os.O_DIRECTORY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise RunDirInUse(
                    f"{run_dir} is in use: another process is training this run there, and the two "
                    "would interleave their metrics and replace each other's checkpoints; wait for "
                    "it or stop it, or give this command its own run.name") from None
            # no flock on this filesystem (ENOLCK, EOPNOTSUPP...): unlocked
        yield
    finally:
        os.close(fd)


@contextlib.contextmanager
def checkpoint_dir_lease(directory: str, cfg, processes):
    """Inside the block, the training's first process holds ``directory``'s lease
    (xtrain/checkpoint/lease.py; ``checkpoint.lease_s=0``: none), taken before the data is
    prepared; the others wait for it, and a refusal refuses them too. Yields the Lease on the
    first process, None elsewhere."""
    from xtrain.checkpoint.lease import Lease

    made = []  # the Lease, kept from before it is taken: a stop (Terminated) landing between its
    # file's write and this block's start still releases it

    def take():
        made.append(Lease(directory, cfg.run.name, cfg.checkpoint.lease_s))
        return made[0].acquire()

    try:
        yield processes.primary_first("taking checkpoint.dir's lease", take) if cfg.checkpoint.lease_s else None
    finally:
        for lease in made:
            lease.release()
