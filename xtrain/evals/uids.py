"""The sandbox's private uids, used when xtrain runs as root (xtrain/evals/sandbox.py): which
uids, claiming one per slot, and what a session leaves behind as one of them: every process
killed, the zombies this process is the parent of collected."""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import os
import subprocess
import tempfile
import threading
import time
from pathlib import Path

# one place for the machine, whatever TMPDIR each process has; the temp dir where /run is
# read-only (a container's read-only root)
_LOCK_DIRS = (Path("/run"), Path(tempfile.gettempdir()))
LOCKS_NAME = "xtrain-sandbox-uids"
_UID_CANDIDATES = 4096  # uids tried below the top of this namespace's uid range
# Nothing of this process's environment (tokens, keys) reaches a sandbox's command.
MINIMAL_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8"}


def claim(count: int, locks: list[int]) -> list[int | None]:
    """``count`` uids of :func:`uid_range` no other sandbox holds, each locked (a lock file whose
    descriptor goes to ``locks``, for the caller to close when it releases them)."""
    directory = lock_dir()
    uids = []
    for uid in reversed(uid_range()):
        fd = os.open(directory / str(uid), os.O_CREAT | os.O_RDWR, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        # unlocked, yet in use (another container's), or its zombies (an earlier evaluation's
        # orphans, not collected yet) still count against its process limit
        if _processes_of(uid, zombies=True):
            os.close(fd)
            continue
        locks.append(fd)
        uids.append(uid)
        if len(uids) == count:
            return uids
    raise RuntimeError(f"C++ sandbox: all {_UID_CANDIDATES} sandbox uids are in use")


def lock_dir() -> Path:
    """The dir of the uids' lock files, made if missing: the first of :data:`_LOCK_DIRS` that
    takes it."""
    for parent in _LOCK_DIRS:
        directory = parent / LOCKS_NAME
        try:
            directory.mkdir(mode=0o755, exist_ok=True)
        except OSError:  # read-only, or no such parent
            continue
        if directory.is_symlink() or directory.stat().st_uid != 0:  # /tmp is world-writable
            raise RuntimeError(f"C++ sandbox: {directory} is not a directory owned by root")
        return directory
    raise RuntimeError(f"C++ sandbox: no writable dir for its uids' locks "
                       f"({', '.join(str(p) for p in _LOCK_DIRS)})")


def kill_all_of(uid: int) -> None:
    """SIGKILL every process of ``uid`` (kill(-1) from that uid reaches exactly its own) and wait
    until they are gone: dying takes a while for dozens of busy processes on two cores, and the
    slot's next program must not find its process count used up.

    The kill comes first, even when a scan would find nothing: a scan of /proc is not atomic (a
    process it lists may fork and exit before its state is read, and the child, started after
    the listing, is missed), while kill(-1) reaches every process of the uid at once, a fork
    under way included. After it no process of the uid can start another, so a later scan that
    finds none alive is final."""
    # kill(-1) from root would kill every process on the machine: only ever as a sandbox uid
    # (subprocess exits before exec when the switch to `uid` fails).
    if not isinstance(uid, int) or uid <= 0:
        raise ValueError(f"refusing to kill all processes of uid {uid!r}")
    deadline = time.monotonic() + 10
    while True:
        # procps kill: `kill -9 -1` is its documented "kill all processes you can kill" (it
        # rejects `--` before -1). user= is spelled out here, not taken from sandbox.py's
        # _as_user: this call must never run as root.
        subprocess.run(["kill", "-9", "-1"], env=MINIMAL_ENV, capture_output=True,
                       check=False, user=uid, group=uid, extra_groups=[])
        if not _processes_of(uid):
            break
        if time.monotonic() > deadline:
            raise RuntimeError(f"C++ sandbox: processes of uid {uid} survive SIGKILL for 10 s")
        time.sleep(0.01)
    _reap_orphans(uid)


PR_SET_CHILD_SUBREAPER = 36  # <linux/prctl.h>
_adopters = [0]  # programs running that adopt orphans (a count: sessions run in threads)
_adopters_lock = threading.Lock()


@contextlib.contextmanager
def adopting(uid: int | None):
    """While a sandboxed program of ``uid`` runs (as root: uid slots), this process adopts its
    descendants' orphans (Linux's child subreaper). bubblewrap exits once its program has, before
    the init of its PID namespace does, and a timeout kills it first: that init was left to PID 1,
    which in a container often never reaps (tail -f /dev/null, sleep infinity), and its zombie
    counted against the uid's process limit until the slot's compiles could not fork. Adopted,
    :func:`kill_all_of` reaps it. Only meanwhile: an orphan of anything else would stay this
    process's zombie."""
    if uid is None:
        yield
        return
    with _adopters_lock:
        if not _adopters[0]:
            _set_subreaper(1)
        _adopters[0] += 1
    try:
        yield
    finally:
        with _adopters_lock:
            _adopters[0] -= 1
            if not _adopters[0]:
                _set_subreaper(0)


def _set_subreaper(on: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, on, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER) failed")


def _reap_orphans(uid: int) -> None:
    """Collect the exit status of ``uid``'s zombies this process is the parent of: a program's
    orphans (and bubblewrap's own) are reparented to it when it is PID 1 (a container's entry
    point) or a subreaper, and a zombie still counts against the uid's process limit, which
    would leave the slot's next compile unable to fork."""
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):  # gone meanwhile, or no child of this process
            stat = Path(f"/proc/{entry.name}/stat").read_text().rsplit(")", 1)[1].split()
            if entry.stat().st_uid == uid and stat[0] == "Z" and int(stat[1]) == os.getpid():
                os.waitpid(int(entry.name), os.WNOHANG)


def _processes_of(uid: int, zombies: bool = False) -> list[int]:
    """Live processes of ``uid`` (with ``zombies``, its zombies too). Zombies are not waited for
    after a session: nothing runs in them, and collecting their exit status is up to their
    parent or init (which may take a few seconds)."""
    pids = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            with contextlib.suppress(OSError):  # exited while scanning
                if entry.stat().st_uid == uid and (zombies or not _is_zombie(entry.name)):
                    pids.append(int(entry.name))
    return pids


def _is_zombie(pid: str) -> bool:
    """Whether every thread of ``pid`` is dead: a process whose leader thread exited shows the
    leader's state (Z) while its other threads may run on."""
    for task in os.listdir(f"/proc/{pid}/task"):
        stat = Path(f"/proc/{pid}/task/{task}/stat").read_text()
        if stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X"):
            return False
    return True


def count_own() -> int:
    """What this process's uid has against its process limit: the kernel counts every task
    (each thread of each process, zombies until reaped), and a training process alone runs
    dozens of threads."""
    total = 0
    for pid in _processes_of(os.getuid(), zombies=True):
        with contextlib.suppress(OSError):  # exited meanwhile
            total += len(os.listdir(f"/proc/{pid}/task"))
    return total


NOT_SANDBOX_UIDS = (65534, 65535)  # nobody, and (uint16)-1


def uid_range() -> list[int]:
    """The uids sandboxed programs run as when xtrain runs as root: the top of the uid range
    this process may switch to (below 2^31, as some tools read uids as signed; never
    :data:`NOT_SANDBOX_UIDS`, which a map ending at 65536, a rootless container's, reaches), far
    above any account."""
    top = min(2**31 - 1, _top_of_uid_map()) - 2
    below = range(top - _UID_CANDIDATES - len(NOT_SANDBOX_UIDS) + 1, top + 1)
    return [uid for uid in below if uid not in NOT_SANDBOX_UIDS][-_UID_CANDIDATES:]


def _top_of_uid_map() -> int:
    """The highest uid this process can switch to (its user namespace's mapped range)."""
    top = 65533
    with contextlib.suppress(OSError), open("/proc/self/uid_map") as f:
        for line in f:
            inside, _, length = (int(x) for x in line.split())
            top = max(top, inside + length - 1)
    return top
