"""One training at a time in a run dir. Two commands training the same run (the same command in
two terminals, or a sweep job and a single run of the same name) would interleave their
metrics.jsonl records, replace each other's checkpoints step by step and overwrite its record.

The lock is ``flock`` on the run dir itself (no file is added to it), held by the training's first
process until training ends: the kernel drops it when the process ends however it ends (a crash,
SIGKILL), so no stale lock outlives a training. Where the filesystem has no ``flock`` (some
network filesystems) the run goes on unlocked.
"""

from __future__ import annotations

import errno
import fcntl
import os

from xtrain.errors import ConfigError


def lock_run_dir(run_dir: str) -> int:
    """Take the run dir's lock; returns its file descriptor, to be closed when training ends.
    Refused while another process trains there."""
    fd = os.open(run_dir, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
            return fd  # no flock here (ENOLCK, EOPNOTSUPP...): unlocked
        os.close(fd)
        raise ConfigError(
            f"{run_dir} is in use: another process is training this run there, and the two would "
            "interleave their metrics and replace each other's checkpoints; wait for it or stop "
            "it, or give this command its own run.name") from None
    return fd
