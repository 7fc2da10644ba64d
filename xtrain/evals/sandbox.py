"""A sandbox for compiling and running untrusted C++ (whatever a model writes).

Each program gets a :class:`Session`: a fresh temp dir, removed afterwards. Compiler and program
both run inside it (the compiler too: ``#include "/etc/..."`` would otherwise copy a file into the
compiler message). Every command runs

- as a private unprivileged uid when xtrain runs as root (root ignores RLIMIT_NPROC and may write
  anywhere). Each parallel slot claims its own uid with a lock file under /run (one place for
  the machine, whatever TMPDIR each process has; the temp dir where /run is read-only) and only
  while no process runs as it (another container's, say), so two slots (or two xtrain
  processes) never share a process count, and after a session every process of that uid is
  killed, even one that left its process group, and its zombies this process is the parent of
  are collected (as PID 1, or a subreaper);
- under resource limits set by util-linux ``prlimit`` before exec (CPU seconds, address space,
  file size, process count, open files, no core files): a program, not a ``preexec_fn``, because
  the harness forks from several threads; first in line for the OOM killer (util-linux
  ``choom``, ``oom_score_adj`` 1000): memory is bounded per process only (below), and when the
  machine runs out the kernel must kill a sample, not the training process beside it;
- in its own process group, SIGKILLed as a whole when the wall-clock limit passes;
- with stdout and stderr sent to files in the session dir, so RLIMIT_FSIZE caps them and a
  program printing forever dies of SIGXFSZ instead of filling a pipe or the disk;
- inside bubblewrap (``bwrap``, Debian package ``bubblewrap``), the well-kept tool Flatpak uses:
  new user, PID, network, IPC and UTS namespaces (no network at all, not even loopback; from
  bubblewrap 0.8 no nested user namespace), a read-only view of /usr only (no /root, /home,
  /work, /etc secrets), a read-only root and /dev, the session's own dirs as /box (its working
  dir), /tmp and /dev/shm and nothing else writable, killed with its parent. /tmp and /dev/shm are not bubblewrap's tmpfs, and its root
  (a tmpfs too) is read-only: a tmpfs is RAM, unbounded (its ``--size`` needs bubblewrap 0.7,
  newer than Ubuntu 22.04's), and one program could fill the host's memory.

What the limits do not bound: the address space is per process, so a program's processes
together may hold up to ``max_processes`` x ``run_memory_mb``; the session dir is on the host's
temp filesystem, where the file size limit caps each file, not their number (CPU time bounds
how much a program writes).

Fallback (``eval.sandbox=rlimits``, or ``auto`` as root when bwrap is missing or cannot create
namespaces): everything above except the bubblewrap layer, plus ``unshare --user --net`` when the
kernel allows it. The program then sees the real filesystem with its uid's rights (world-writable
dirs such as /tmp are writable) and shares the PID namespace; a one-line warning says so.
Without root there is no private uid either: the program would run as this process's user, able
to change that user's files (checkpoints, keys) and to read this process's environment
(secrets: /proc/<pid>/environ of the same uid, with or without unshare). ``auto`` refuses that;
only an explicit ``eval.sandbox=rlimits`` runs it.
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from xtrain.errors import ConfigError
from xtrain.evals import uids
from xtrain.evals.config import EvalConfig

INSTALL = "sudo apt-get install bubblewrap"
# no user namespace of its own for the program (a nested one would open more of the kernel to it)
NO_USERNS = ("--unshare-user", "--disable-userns")
# a program every sandbox can start, to probe it: /bin/true on a merged /usr (where /bin links to
# usr/bin) and on a split one (Debian 11), which has no /usr/bin/true
BARE_PROGRAM = "/bin/true"
_warned: list[list[str]] = []


class Cancelled(Exception):
    """The evaluation was called off (its run is stopping)."""


@dataclass(frozen=True)
class Limits:
    wall_s: float  # killed (whole process group) after this many seconds
    cpu_s: int  # SIGXCPU after this many CPU seconds per process
    memory_mb: int  # address space per process
    file_kb: int  # largest file any process may write (stdout and stderr included)
    processes: int  # processes of the sandbox uid at once
    open_files: int


@dataclass(frozen=True)
class Result:
    returncode: int  # 128 + signal number when a signal ended it (as a shell reports it)
    timed_out: bool  # the wall-clock limit passed and the process group was killed
    stdout: str  # all of it: RLIMIT_FSIZE bounds it to Limits.file_kb
    stderr: str
    seconds: float


def limits_for(cfg: EvalConfig, compile: bool) -> Limits:
    """The limits of a compile or of a test run, from the eval config."""
    wall = cfg.compile_timeout_s if compile else cfg.run_timeout_s
    return Limits(wall_s=wall, cpu_s=math.ceil(wall) + 1,
                  memory_mb=cfg.compile_memory_mb if compile else cfg.run_memory_mb,
                  file_kb=cfg.max_file_kb * (64 if compile else 1),  # the binary is a file too
                  processes=cfg.max_processes, open_files=cfg.max_open_files)


class Sandbox:
    """Chooses the isolation once (bubblewrap or the fallback), claims ``slots`` uids when root,
    and hands out sessions; :meth:`close` releases the uids. ``cancel`` (a threading.Event) set:
    a session not started raises :class:`Cancelled`, and so does a running command, killed."""

    def __init__(self, cfg: EvalConfig, slots: int, cancel: threading.Event | None = None):
        self.cfg, self.cancel = cfg, cancel
        self._uid_locks: list[int] = []
        self._free: list[int | None] = [None] * slots
        self._lock = threading.Condition()
        self.missing: list[str] = []  # protections the fallback lacks (empty under bwrap)
        self.mode = "bwrap"  # until the probe says otherwise
        try:
            if os.geteuid() == 0:
                self._free = uids.claim(slots, self._uid_locks)
            self.mode = self._choose_mode()
        except BaseException:
            self.close()
            raise
        if self.missing and self.missing not in _warned:  # once per process, not per eval
            _warned.append(self.missing)
            print(f"xtrain: warning: C++ eval sandbox without bubblewrap: "
                  f"{'; '.join(self.missing)}", file=sys.stderr, flush=True)

    def _choose_mode(self) -> str:
        root = os.geteuid() == 0
        if self.cfg.sandbox in ("auto", "bwrap"):
            bwrap = shutil.which("bwrap")
            self._bwrap = [] if bwrap is None else self._bwrap_argv(bwrap)
            problem = f"bwrap not found ({INSTALL})" if bwrap is None else \
                self._probe_bwrap()
            if problem is not None and NO_USERNS[-1] in self._bwrap:
                # it needs a user namespace of bwrap's own (a setuid bwrap may have none)
                self._bwrap = [a for a in self._bwrap if a not in NO_USERNS]
                problem = self._probe_bwrap()
            if problem is None:
                return "bwrap"
            if self.cfg.sandbox == "bwrap":
                raise ConfigError(f"eval.sandbox=bwrap: {problem}")
            if not root:
                raise ConfigError(
                    f"eval.sandbox=auto: {problem}, and without root the fallback would run the "
                    "generated programs as this user, able to change its files: make bubblewrap "
                    "work here, or accept that with eval.sandbox=rlimits")
            self.missing.append(problem)
        self._unshare = ["unshare", "--user", "--net", "--"]
        if self._probe(self._unshare + [BARE_PROGRAM]) is not None:
            self._unshare = []
            self.missing.append("no network isolation (unshare --user --net not permitted)")
        if not root:  # same uid, same PID namespace: /proc/<this pid>/environ is readable
            self.missing.append("the program may read this process's environment (secrets)")
        outlives = "a daemon it starts may outlive it" + ("" if root else ", running as this user")
        self.missing.append("no read-only filesystem view (the program may write wherever its "
                            f"uid may) and no PID namespace ({outlives})")
        return "rlimits"

    def _probe_bwrap(self) -> str | None:
        with tempfile.TemporaryDirectory(prefix="xtrain-cpp-probe-") as root:
            os.chmod(root, 0o711)
            _make_writable_dirs(Path(root), next((u for u in self._free if u is not None), None))
            return self._probe(self._inside(Path(root)) + [BARE_PROGRAM])

    def _probe(self, argv: list[str]) -> str | None:
        """None when ``argv`` runs as a sandboxed command would, else its error."""
        uid = next((u for u in self._free if u is not None), None)
        try:
            with uids.adopting(uid):
                done = subprocess.run(argv, capture_output=True, text=True, timeout=30,
                                      **_as_user(uid))
        except (OSError, subprocess.TimeoutExpired) as e:
            return f"{argv[0]} failed: {e}"
        finally:
            if uid is not None:
                uids.kill_all_of(uid)  # (and reaps what it adopted)
        if done.returncode != 0:
            return f"{argv[0]} failed: {done.stderr.strip().splitlines()[-1:] or done.returncode}"
        return None

    def _bwrap_argv(self, bwrap: str) -> list[str]:
        """bubblewrap's arguments shared by every session: namespaces, a read-only /usr (and
        the toolchain's prefix if elsewhere), /proc and /dev; no /root, /home, /work or /etc."""
        argv = [bwrap, "--unshare-all", "--die-with-parent", "--new-session", "--clearenv",
                "--setenv", "PATH", "/usr/local/bin:/usr/bin:/bin", "--setenv", "HOME", "/box",
                "--setenv", "LANG", "C.UTF-8", "--ro-bind", "/usr", "/usr"]
        if NO_USERNS[-1] in subprocess.run([bwrap, "--help"], capture_output=True, text=True).stdout:
            argv += NO_USERNS  # bubblewrap 0.8+
        for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
            if os.path.islink(top):  # merged /usr (Debian 12): these are symlinks into /usr
                argv += ["--symlink", os.readlink(top), top]
            elif os.path.isdir(top):
                argv += ["--ro-bind", top, top]
        for path in ("/etc/ld.so.cache", "/etc/alternatives"):
            argv += ["--ro-bind-try", path, path]
        gxx = shutil.which(self.cfg.gxx)
        prefix = toolchain_prefix(gxx) if gxx else None
        if prefix:  # a toolchain installed elsewhere (xtrain/evals/harness.py find_gxx checks it)
            argv += ["--ro-bind", str(prefix), str(prefix)]
        return argv + ["--proc", "/proc", "--dev", "/dev"]

    def _inside(self, root: Path) -> list[str]:
        """The command prefix that puts a program inside the sandbox of session dir ``root``
        (:func:`_make_writable_dirs`), working in its box."""
        if self.mode == "bwrap":
            binds = [arg for name, inside in WRITABLE.items()
                     for arg in ("--bind", str(root / name), inside)]
            # bwrap's own root is a tmpfs (RAM) the program could fill: read-only, like /dev
            return self._bwrap + binds + ["--remount-ro", "/dev", "--remount-ro", "/",
                                          "--chdir", "/box", "--"]
        return self._unshare

    @contextlib.contextmanager
    def session(self):
        """A fresh temp dir and a uid slot for one program; both cleaned up on exit."""
        self.check_cancelled()
        with self._lock:
            while not self._free:
                self._lock.wait()
            uid = self._free.pop()
        root = None
        try:
            root = Path(tempfile.mkdtemp(prefix="xtrain-cpp-"))
            os.chmod(root, 0o711)  # the sandbox uid may reach box/, not list or read the logs
            _make_writable_dirs(root, uid)
            yield Session(self, root, root / "box", uid)
        finally:
            try:
                if uid is not None:
                    uids.kill_all_of(uid)
                if root is not None:
                    _remove(root)
            finally:
                with self._lock:
                    self._free.append(uid)
                    self._lock.notify()

    def check_cancelled(self) -> None:
        if self.cancel is not None and self.cancel.is_set():
            raise Cancelled("the run is stopping")

    def close(self) -> None:
        for fd in self._uid_locks:
            os.close(fd)
        self._uid_locks.clear()


class Session:
    """One program's temp dir: write files into it, run commands in it."""

    def __init__(self, sandbox: Sandbox, root: Path, box: Path, uid: int | None):
        self.sandbox, self.root, self.box, self.uid = sandbox, root, box, uid

    def write(self, name: str, text: str) -> None:
        (self.box / name).write_text(text)

    def run(self, argv: list[str], limits: Limits) -> Result:
        """Run ``argv`` under ``limits``, working in the session dir (use relative paths)."""
        argv = (_limited(limits, self._process_limit(limits)) + self.sandbox._inside(self.root)
                + argv)
        out_path, err_path = self.root / "stdout", self.root / "stderr"
        start = time.perf_counter()
        with open(out_path, "wb") as out, open(err_path, "wb") as err, uids.adopting(self.uid):
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                    cwd=self.box, env=_minimal_env(), start_new_session=True,
                                    **_as_user(self.uid))
            deadline = start + limits.wall_s
            try:  # in slices, so that a cancel ends it within a tenth of a second
                while proc.poll() is None and time.perf_counter() < deadline:
                    self.sandbox.check_cancelled()
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        proc.wait(timeout=min(0.1, max(0.0, deadline - time.perf_counter())))
            finally:
                timed_out = proc.poll() is None
                if timed_out:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(proc.pid, 9)  # the group: prlimit/bwrap and what they started
                    proc.wait()
        seconds = time.perf_counter() - start
        code = proc.returncode if proc.returncode >= 0 else 128 - proc.returncode
        return Result(code, timed_out, _read(out_path), _read(err_path), seconds)

    def _process_limit(self, limits: Limits) -> int:
        # A private uid counts only this session's processes. Without root the uid is shared
        # with everything else the account runs (every thread counts), so the limit is on top
        # of those.
        return limits.processes if self.uid is not None else limits.processes + uids.count_own()


def toolchain_prefix(gxx: str) -> Path | None:
    """The install prefix of the compiler at ``gxx`` (its bin/'s parent) when outside /usr: the
    bubblewrap sandbox shows it to the programs, read-only."""
    prefix = Path(os.path.realpath(gxx)).parent.parent
    return None if str(prefix).startswith("/usr") else prefix


# A session dir's dirs the program may write, and where bubblewrap shows them (the fallback
# runs in box/ and leaves the other two unused).
WRITABLE = {"box": "/box", "tmp": "/tmp", "shm": "/dev/shm"}


def _make_writable_dirs(root: Path, uid: int | None) -> None:
    for name in WRITABLE:
        (root / name).mkdir(mode=0o700)
        if uid is not None:
            os.chown(root / name, uid, uid)


def _limited(limits: Limits, processes: int) -> list[str]:
    """The command prefix that puts a command first in line for the OOM killer and under
    ``limits``. CPU: the soft limit sends SIGXCPU (reported as a timeout), the hard one a second
    later SIGKILL."""
    return ["choom", "-n", "1000", "--", "prlimit", f"--cpu={limits.cpu_s}:{limits.cpu_s + 1}",
            f"--as={limits.memory_mb << 20}", f"--fsize={limits.file_kb << 10}",
            f"--nproc={processes}", f"--nofile={limits.open_files}", "--core=0", "--"]


def _as_user(uid: int | None) -> dict:
    """Popen arguments that drop root to ``uid`` (same-numbered group, no supplementary
    groups); done by subprocess between fork and exec, safe from threads."""
    return {} if uid is None else {"user": uid, "group": uid, "extra_groups": []}


def _minimal_env() -> dict[str, str]:
    return dict(uids.MINIMAL_ENV)


def _remove(root: Path) -> None:
    """Delete a session dir whatever its program left there. GNU rm, not shutil.rmtree: rmtree
    recurses once per directory level, and a program can nest dirs deeper than Python's
    recursion limit. Without root, a dir whose permissions the program took away is given them
    back first (chmod skips symlinks while it recurses)."""
    def rm():
        subprocess.run(["rm", "-rf", "--", str(root)], env=_minimal_env(), capture_output=True,
                       check=False)
    rm()
    if root.exists():
        subprocess.run(["chmod", "-R", "u+rwx", "--", str(root)], env=_minimal_env(),
                       capture_output=True, check=False)
        rm()
    if root.exists():
        print(f"xtrain: warning: C++ eval sandbox: could not delete {root}", file=sys.stderr,
              flush=True)


def _read(path: Path) -> str:
    return path.read_bytes().decode("utf-8", errors="replace")


