"""One job on one worker: start it detached, follow its log, poll it, stop it.

The job runs in its own session (``setsid``), its output going to a log file and its exit code to
a file, so an SSH drop does not touch it and a later launch finds it again:

    <remote_dir>/jobs/<job>/ run.sh  pid  boot  command  attempt  starts  log  exit  reported

``pid`` is the session (and process-group) leader, so a stop signals every process of the job.
``boot`` is the kernel's boot id when it started: after a VM restart the same pid may belong to
an unrelated process group, which is then neither reported running nor signalled. ``command``
is a digest of the job's command line: a launch reattaches only to the job of its own command.
``reported`` is written once a launcher has seen the end: a job that ended unwatched (the local
side was gone) is reported by the next launch instead of being started again.
"""

from __future__ import annotations

import hashlib
import json
import shlex
from dataclasses import dataclass

from xtrain.errors import EXIT_STOPPED
from xtrain.launcher.runner import LaunchError, VmUnavailable, parallel

q = shlex.quote

# group_alive: whether process group $1 has a live member. Not `kill -0`: that also counts
# zombies, which stay forever where PID 1 does not reap them (some containers).
# job_group: whether process group $2 is job dir $1's: started this boot and alive, and not, once
# the job has exited, led by a live process of another command than the job's wrapper (its pid
# reused by a new group: its own orphans would have kept the pid from reuse).
GROUP_ALIVE_SH = r"""
group_alive() { ps -e -o pgid=,stat= | awk -v g="$1" '$1 == g && $2 !~ /^Z/ {f=1} END {exit !f}'; }
this_boot() { [ ! -f "$1/boot" ] || [ "$(cat "$1/boot")" = "$(cat /proc/sys/kernel/random/boot_id)" ]; }
other_leader() { ps -o stat=,args= -p "$2" 2>/dev/null |
  awk -v w="$1/run.sh" '$1 !~ /^Z/ && index($0, w) == 0 {f=1} END {exit !f}'; }
job_group() { this_boot "$1" && group_alive "$2" && ! { [ -f "$1/exit" ] && other_leader "$1" "$2"; }; }
"""

# Prints "<state> <exit code or -> <reported 0|1> <attempt or -> <log bytes> <command digest or ->"
# for job dir $1.
# state: none (never started), running, exited, lost (gone without an exit code: killed or the
# VM restarted).
STATE_SH = GROUP_ALIVE_SH + r"""
# a file's one word, or - (missing, or empty: a start on a full disk writes empty files)
word() { w=$(cat "$1" 2>/dev/null); echo "${w:--}"; }
job_state() {
  pid=$(cat "$1/pid" 2>/dev/null)
  if [ -z "$pid" ]; then s=none
  elif [ -f "$1/exit" ]; then s=exited
  elif this_boot "$1" && group_alive "$pid"; then s=running
  else s=lost; fi
  printf '%s %s %s %s %s %s\n' "$s" "$(word "$1/exit")" \
    "$([ -f "$1/reported" ] && echo 1 || echo 0)" "$(word "$1/attempt")" \
    "$(stat -c %s "$1/log" 2>/dev/null || echo 0)" "$(word "$1/command")"
}
"""

# SIGTERM to the job's process group (xtrain checkpoints at the next step boundary and exits 143),
# SIGKILL after the grace period, then wait until the group is gone. Expects $dir (the job's),
# $pid and $ticks (the grace in fifths of a second).
STOP_SH = GROUP_ALIVE_SH + r"""
if job_group "$dir" "$pid"; then
  kill -TERM -- "-$pid" 2>/dev/null
  while group_alive "$pid"; do
    if [ "$ticks" -eq 0 ]; then kill -KILL -- "-$pid" 2>/dev/null; echo killed; fi
    sleep 0.2; ticks=$(( ticks - 1 ))
  done
fi
"""


def grace_ticks(grace_s: float) -> int:
    """STOP_SH's $ticks for a grace of ``grace_s`` seconds."""
    return max(0, round(grace_s * 5))


# The job's wrapper: records its pid, loads the secrets (then deletes them), and stays alive to
# write the exit code. Signals go to the whole group: the wrapper survives them (handled by `true`
# until the job is forked, so the job starts with the default actions; ignored from then on, so
# that they cannot interrupt `wait`, which would return 128 + signal instead of the job's code).
# Bash without job control starts a job in the background with SIGINT and SIGQUIT ignored: the
# job's subshell puts their default actions back before it becomes the job.
RUN_SH = """# xtrain job {job}, attempt {attempt} (written by xtrain/launcher/job.py)
J={jobdir}
cat /proc/sys/kernel/random/boot_id > "$J/boot"
echo $$ > "$J/pid"
if [ -f "$J/secrets" ]; then set -a; . "$J/secrets"; set +a; rm -f "$J/secrets"; fi
{exports}
cd {cwd} || exit 97
trap true TERM INT HUP
( trap - INT QUIT; exec {command} ) &
child=$!
trap '' TERM INT HUP
wait $child; rc=$?
echo $rc > "$J/exit.tmp" && mv "$J/exit.tmp" "$J/exit"
"""


@dataclass(frozen=True)
class JobState:
    state: str  # none | running | exited | lost
    exit_code: int | None
    reported: bool
    attempt: str | None
    log_bytes: int
    command: str | None  # command_digest of the job's command (None: started before it was kept)

    @classmethod
    def parse(cls, line: str) -> "JobState":
        state, code, reported, attempt, size, command = line.split()
        return cls(state, None if code == "-" else int(code), reported == "1",
                   None if attempt == "-" else attempt, int(size), None if command == "-" else command)

    @property
    def unreported_end(self) -> bool:
        return self.state == "exited" and not self.reported

    @property
    def failed(self) -> bool:
        """Ended otherwise than finished or stopped after a checkpoint (xtrain's exit 143)."""
        return self.state == "lost" or self.exit_code not in (0, EXIT_STOPPED)

    def describe(self) -> str:
        if self.state == "lost":
            return "ended without an exit code: killed, or the VM restarted"
        if self.state == "none":
            return "never started there"
        return f"exit code {self.exit_code}"


class RemoteJob:
    def __init__(self, worker, job_id: str):
        self.worker, self.job_id = worker, job_id
        self.dir = f"{worker.root}/jobs/{job_id}"

    def state(self) -> JobState:
        r = self.worker.run(STATE_SH + f"job_state {q(self.dir)}\n", "poll")
        return JobState.parse(r.stdout.strip().splitlines()[-1])

    def start(self, command: list[str], cwd: str, env: dict[str, str], secrets: dict[str, str],
              attempt: str, grace_s: float, tpu_lockfile: str | None) -> int:
        """Clean up what an earlier run of this job left, then start it detached; returns its pid.
        Secrets travel inside this script, on ssh's stdin, into a 0600 file the job deletes."""
        d = q(self.dir)
        run_sh = RUN_SH.format(job=self.job_id, attempt=attempt, jobdir=d, cwd=q(cwd),
                               exports="\n".join(f"export {k}={q(str(v))}" for k, v in env.items()),
                               command=" ".join(q(a) for a in command))
        script = "\n".join([
            f"mkdir -p {d}", f"dir={d}; pid=$(cat {d}/pid 2>/dev/null); ticks={grace_ticks(grace_s)}",
            'if [ -n "$pid" ]; then', STOP_SH, "fi",
            _clear_lock_sh(tpu_lockfile) if tpu_lockfile else "",
            f"rm -f {d}/exit {d}/reported {d}/pid {d}/boot {d}/secrets",
            f"echo {command_digest(command)} > {d}/command", f"echo {q(attempt)} > {d}/attempt", f'echo "{attempt} $(date +%s.%N)" >> {d}/starts',
            f"(umask 077; cat > {d}/secrets) <<'{_eof(secrets)}'", *_env_lines(secrets), _eof(secrets),
            f"cat > {d}/run.sh <<'XTRAIN_RUN_SH_END'", run_sh.rstrip("\n"), "XTRAIN_RUN_SH_END",
            # (setsid forks: a job bash starts with & would ignore SIGINT, as the job below)
            f"setsid -f bash {d}/run.sh > {d}/log 2>&1 < /dev/null",
            f"for i in $(seq 200); do [ -s {d}/pid ] && break; sleep 0.05; done",
            f"[ -s {d}/pid ] || {{ echo \"the job did not start: $(tail -n 3 {d}/log)\" >&2; exit 4; }}",
            f"echo started $(cat {d}/pid)"])
        r = self.worker.run(script, "start")
        if not r.ok:
            # exit 3: the TPU is held by another program (_clear_lock_sh), before anything started
            error = VmUnavailable if r.returncode == 3 else LaunchError
            raise error(f"worker {self.worker.index} ({self.worker.host}): could not start "
                        f"the job: {r.stdout.strip()} {r.stderr.strip()}".strip())
        return int(r.stdout.split()[-1])

    def follow(self, offset: int):
        """Stream the log from byte ``offset`` until the job's wrapper exits (tail --pid); when
        its pid is not the job's group (the VM restarted, or the job exited and the pid was
        reused: GROUP_ALIVE_SH's job_group), print the log to its end and return."""
        d, tail = q(self.dir), f"tail -c +{offset + 1}"
        return self.worker.ssh.stream(
            self.worker.host, GROUP_ALIVE_SH + f'pid=$(cat {d}/pid)\n'
            f'if job_group {d} "$pid"; then exec {tail} -s 0.2 --pid="$pid" '
            f'-F {d}/log; else exec {tail} {d}/log; fi', "follow")

    def stop(self, grace_s: float) -> bool:
        """SIGTERM, then SIGKILL after ``grace_s``; True when it had to be killed."""
        d = q(self.dir)
        r = self.worker.run(f"dir={d}; pid=$(cat {d}/pid 2>/dev/null) || exit 0; "
                            f"ticks={grace_ticks(grace_s)}\n" + STOP_SH, "stop",
                            timeout=grace_s + 120)
        return "killed" in r.stdout

    def acknowledge(self) -> None:
        """Mark the end as seen, so the next launch starts afresh instead of reporting it."""
        self.worker.run(f"touch {q(self.dir)}/reported\n", "acknowledge")


def command_digest(command: list[str]) -> str:
    """What tells one command from another (``python -m xtrain`` and its overrides). The
    overrides' order counts only where it changes the config: two of one key, or of a key and a
    key inside it, apply in turn; otherwise ``a=1 b=2`` and ``b=2 a=1`` are one command."""
    start = command.index("xtrain") + 1 if "xtrain" in command else len(command)
    keys = [arg.split("=", 1)[0].lstrip("+~") for arg in command[start:]]
    in_turn = any(a == b or b.startswith(a + ".") for i, a in enumerate(keys)
                  for j, b in enumerate(keys) if i != j) or any(k.startswith("-") for k in keys)
    canonical = command if in_turn else command[:start] + sorted(command[start:])
    return hashlib.sha256(json.dumps(canonical).encode()).hexdigest()[:16]


def _env_lines(values: dict[str, str]) -> list[str]:
    return [f"{k}={q(v)}" for k, v in values.items()]


def _eof(values: dict[str, str]) -> str:
    """A here-document delimiter that no secret line can end early."""
    token = "XTRAIN_SECRETS_END"
    while any(token in line for line in _env_lines(values)):
        token += "_"
    return token


def _clear_lock_sh(lockfile: str) -> str:
    """libtpu's lock file outlives a killed run and makes the next one fail: remove it when no
    process holds it open; refuse when one does (another program is using the TPU)."""
    lock = q(lockfile)
    return (f'if [ -e {lock} ]; then\n'
            f'  holder=$(find /proc/[0-9]*/fd -lname {lock} 2>/dev/null | head -n 1 | cut -d/ -f3)\n'
            f'  if [ -z "$holder" ]; then rm -f {lock}; else\n'
            f'    echo "the TPU is in use: process $holder holds {lockfile}:" '
            f'"$(tr "\\0" " " < /proc/$holder/cmdline)"; exit 3; fi\n'
            'fi')


def stop_others(jobs, grace_s: float, log, acknowledge: bool = False) -> None:
    """Stop a pod's other workers after one failed (a pod's workers wait on each other), and with
    ``acknowledge`` mark their ends seen; one that cannot be reached is named, its error kept from
    replacing the failure being reported."""
    def stop(job):
        try:
            killed = job.stop(grace_s)
            if acknowledge:
                job.acknowledge()
            return killed
        except Exception as e:  # noqa: BLE001  (unreachable, a refused login: named, not raised)
            return e

    for job, outcome in zip(jobs, parallel(stop, jobs)):
        if isinstance(outcome, Exception):
            log(f"launch: {job.worker} could not be stopped ({outcome}); once it answers, "
                "hydra.launcher.stop=true stops it")
        elif outcome:
            log(f"launch: {job.worker} did not stop within {grace_s:g} s of SIGTERM: killed")
