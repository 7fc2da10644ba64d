"""One machine of a launch: its addresses, its directories, and the probe that learns in a
single call what is there (home, tools, the environment's stamp, this job's state, other jobs)."""

from __future__ import annotations

import contextlib
import secrets
import shlex
import socket
import subprocess
import time
from dataclasses import dataclass, field

from xtrain.errors import ConfigError
from xtrain.launcher.env import STAMP, SYSTEM_TOOLS
from xtrain.launcher.job import STATE_SH, JobState
from xtrain.launcher.runner import LaunchError, VmUnavailable

q = shlex.quote
TOOLS = ("bash", "rsync", "setsid", "tail", "find", "ps", "awk", "flock")

# Holds the worker's launch lock (util-linux flock on <remote dir>/launch.lock) while stdin stays
# open. Says "<LOCK_MARK> busy <holder>" first when another launch holds it (its holder line,
# written beside the lock), "<LOCK_MARK> timeout <holder>" when one still holds it after $wait
# seconds, and "<LOCK_MARK> locked" once this one holds it; a failure ends it without that, its
# error on the same stream.
LOCK_MARK = "XTRAIN-LOCK"
LOCK_SH = f"""exec 2>&1
exec 9>>"$root/launch.lock" || exit 1
flock -n -E 75 9; rc=$?
if [ "$rc" = 75 ]; then echo "{LOCK_MARK} busy $(cat "$root/launch.holder" 2>/dev/null)"
  flock -w "$wait" -E 75 9; rc=$?
  if [ "$rc" = 75 ]; then echo "{LOCK_MARK} timeout $(cat "$root/launch.holder" 2>/dev/null)"
    exit 1
  fi
fi
[ "$rc" = 0 ] || exit 1
echo "$holder" > "$root/launch.holder"
echo {LOCK_MARK} locked
exec cat > /dev/null
"""


@dataclass
class Probe:
    stamp: str | None
    job: JobState
    busy: list[str] = field(default_factory=list)  # other jobs running there: "name pid"
    ended: list[str] = field(default_factory=list)  # other jobs that ended unwatched: names
    ran: list[str] = field(default_factory=list)  # other jobs started there: "name attempt"
    lacks: list[str] = field(default_factory=list)  # SYSTEM_TOOLS not there (jobs may need them)


class Worker:
    def __init__(self, target, ssh, remote_dir: str, venv: str | None):
        self.index, self.host, self.internal = target.index, target.host, target.internal
        self.ssh = ssh
        self._root = remote_dir.replace("{host}", target.host)
        if venv and not venv.startswith(("/", "~")):
            venv = f"{self._root}/{venv}"
        self._venv = venv or f"{self._root}/venv"
        self.root = self.venv = self.code = None  # absolute, known after probe()

    def __repr__(self) -> str:
        return f"worker {self.index} ({self.host})"

    def run(self, script: str, label: str, timeout: float | None = 300):
        return self.ssh.run(self.host, script, label, timeout)

    def python_env(self) -> str:
        """Keeps bytecode out of the synced tree (rsync would delete it at every sync)."""
        return f"PYTHONPYCACHEPREFIX={q(self.root + '/pycache')}"

    def probe(self, job_id: str) -> Probe:
        script = "\n".join([
            STATE_SH,
            f"root={_shell_path(self._root)}; venv={_shell_path(self._venv)}",
            'mkdir -p "$root/code" "$root/jobs" "$root/runs" && cd "$root" && echo "root=$(pwd)"',
            'echo "venv=$venv"',
            *(f'command -v {t} >/dev/null || echo "missing={t}"' for t in TOOLS),
            *(f'command -v {t} >/dev/null || echo "lacks={t}"' for t in SYSTEM_TOOLS),
            f'[ -f "$venv/{STAMP}" ] && echo "stamp=$(cat "$venv/{STAMP}")"',
            f'echo "job=$(job_state "$root/jobs/{job_id}")"',
            'for d in "$root"/jobs/*/; do n=$(basename "$d")',
            f'  [ "$n" = {q(job_id)} ] && continue',
            '  set -- $(job_state "$d"); [ "$1" = running ] && echo "busy=$n pid $(cat "$d/pid")"',
            '  [ "$1" = exited ] && [ "$3" = 0 ] && echo "ended=$n"',
            '  [ "$1" != none ] && echo "ran=$n $4"',
            "done", "exit 0", ""])
        r = self.run(script, "probe", timeout=120)
        values: dict[str, list[str]] = {}
        for line in r.stdout.splitlines():
            key, _, value = line.partition("=")
            values.setdefault(key, []).append(value)
        if not r.ok or "root" not in values:
            raise LaunchError(f"{self}: cannot use {self._root}: {r.stderr.strip() or r.stdout.strip()}")
        if "missing" in values:
            raise LaunchError(f"{self}: missing {', '.join(values['missing'])} (the launcher needs "
                              f"{', '.join(TOOLS)} on every worker)")
        self.root, self.venv = values["root"][0], values["venv"][0]
        self.code = self.root + "/code"
        return Probe(values.get("stamp", [None])[0], JobState.parse(values["job"][0]),
                     values.get("busy", []), values.get("ended", []), values.get("ran", []),
                     values.get("lacks", []))

    def hold_lock(self, holder: str, log, wait_s: float):
        """Take this worker's launch lock (after a probe: the connection and flock are known to
        work) as ``holder`` (``<launch token> <host> <time>``), waiting ``wait_s`` at most for
        another launch's; returns the ssh process that holds it until its stdin is closed. A lock
        held under this launch's own token is another worker's of this launch: the two share one
        remote dir, which no launch can use."""
        script = f"root={q(self.root)}\nholder={q(holder)}\nwait={wait_s:.3f}\n{LOCK_SH}"
        proc = self.ssh.hold(self.host, "bash -c " + q(script), "lock")
        said = []  # anything else: a login script's lines, an error
        while True:
            raw = proc.stdout.readline()
            if not raw:  # the end: flock failed, or the connection did
                proc.wait()
                raise VmUnavailable(f"{self}: could not take {self.root}/launch.lock ("
                                    + ("; ".join(said[-3:]) or "the connection ended") + ")")
            line = raw.decode(errors="replace").rstrip("\n")
            before, mark, told = line.partition(LOCK_MARK)  # (a banner without a newline first)
            if not mark:
                said.append(line)
            elif told.split() == ["locked"]:
                return proc
            elif told.split()[:1] == ["timeout"]:
                proc.wait()
                now = " ".join(told.split()[2:]) or "unknown"  # the holder now, maybe a later one
                raise VmUnavailable(
                    f"{self}: another launch ({now}) still held "
                    f"{self.root}/launch.lock after {wait_s:g} s (hydra.launcher.lock_wait_s); "
                    "a launch whose machine went away holds it until the worker's sshd drops "
                    "that connection")
            elif told.split()[:1] == ["busy"]:
                other = told.split()[1:]
                if other[:1] == holder.split()[:1]:
                    proc.kill()
                    proc.wait()
                    raise ConfigError(f"{self} shares {self.root} with another worker of this "
                                      "launch: each worker needs a remote dir of its own "
                                      "(hydra.launcher.remote_dir with {host} on a shared home)")
                log(f"launch: {self}: another launch ({' '.join(other[1:]) or 'unknown'}) is "
                    "placing a job there: waiting for it")


@contextlib.contextmanager
def launch_lock(workers, log, wait_s: float):
    """Every worker's launch lock, held from the probe the job's placement is decided by to its
    start: a second launch at the same moment waits (``wait_s`` at most for each worker's lock,
    then it is that worker's refusal), then probes and finds the job started
    (reattaching to it) or the worker busy, instead of syncing, installing and starting it a
    second time over the first. Taken in worker order by every launch (the same order whatever
    address reaches a worker): no deadlock. A remote ``cat`` of the ssh session's stdin holds it,
    so however the launcher ends, the session closes and the lock is released. Yields a check
    to call before the start: a lock lost meanwhile (its connection ended) is an error, not a
    start another launch may be making too."""
    holder = f"{secrets.token_hex(4)} {socket.gethostname()} since {time.strftime('%H:%M:%S')}"
    holders = []

    def still_held() -> None:
        for worker, proc in holders:
            if proc.poll() is not None:
                raise VmUnavailable(f"{worker}: the launch lock's connection ended before the "
                                    "start, so nothing was started: run the same command again")

    try:
        for worker in sorted(workers, key=lambda w: w.index):
            holders.append((worker, worker.hold_lock(holder, log, wait_s)))
        yield still_held
    finally:
        for _, proc in holders:
            proc.stdin.close()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _shell_path(path: str) -> str:
    """A remote path for a shell script, quoted: ``~`` is the remote user's home, and so is the
    start of a relative path (as for ssh and rsync: scripts here change directory)."""
    if path == "~":
        return '"$HOME"'
    if path.startswith("~/"):
        return '"$HOME"/' + q(path[2:])
    return q(path) if path.startswith("/") else '"$HOME"/' + q(path)
