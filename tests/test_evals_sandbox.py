"""The C++ sandbox against hostile programs: each is scored as the right kind of failure, within
its time limit, leaving no process, no temp dir and no file outside its dir behind.

All programs run through the real harness, g++ and bubblewrap (nothing mocked). The machine's
facts behind the design are in xtrain/evals/sandbox.py: tests run as root, so the sandbox must
drop to its own uids and namespaces.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from xtrain.errors import ConfigError
from xtrain.evals import EvalConfig, evaluate
from xtrain.evals import sandbox as sandbox_module
from xtrain.evals.problems import Problem
from xtrain.evals import uids as uids_module
from xtrain.evals.sandbox import Cancelled, Sandbox, limits_for
from xtrain.evals.uids import uid_range

RUN_TIMEOUT = 2.0
# Every header a hostile completion below needs (a completion cannot add includes: it starts
# inside the function body).
PROMPT = """#include <arpa/inet.h>
#include <netinet/in.h>
#include <pthread.h>
#include <sched.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>
#include <cstdio>
#include <cstdlib>

// Return 42.
int answer() {
"""
TESTS = """int main() {
  int a = answer();
  std::printf("answer %d\\n", a);
  return a == 42 ? 0 : 1;
}
"""
PROBLEM = Problem(id="hostile", difficulty="easy", prompt=PROMPT, reference="  return 42;\n}\n",
                  tests=TESTS)


def hostile_programs(port: int, outside: str) -> dict[str, tuple[str, str]]:
    """kind -> (completion of PROMPT, the outcome it must get)."""
    return {
        "reference": ("  return 42;\n}\n", "passed"),
        "syntax_error": ("  return 42\n}\n", "compile_error"),
        "wrong_answer": ("  return 41;\n}\n", "wrong_answer"),
        # exit(0) before the tests finish must not count as passing
        "early_exit": ("  std::exit(0);\n}\n", "wrong_answer"),
        "infinite_loop": ("  volatile unsigned long spin = 0;\n  for (;;) spin = spin + 1;\n}\n",
                          "timeout"),
        "sleep_forever": ("  for (;;) pause();\n}\n", "timeout"),
        "fork_bomb": ("  for (;;) fork();\n}\n", "timeout"),
        # bounded twins of the fork bomb and of a descriptor leak: harmless without the limits,
        # so breaking a limit shows up here as a pass instead of harming the machine
        "fork_64": ("  int made = 0;\n  for (int i = 0; i < 64; ++i) {\n    pid_t p = fork();\n"
                    "    if (p == 0) {\n      pause();\n      _exit(0);\n    }\n"
                    "    made += p > 0;\n  }\n  return made == 64 ? 42 : 41;\n}\n",
                    "wrong_answer"),
        "open_1000_files": ("  for (int i = 0; i < 1000; ++i)\n"
                            "    if (std::fopen(\"/dev/null\", \"r\") == nullptr) return 41;\n"
                            "  return 42;\n}\n", "wrong_answer"),
        # 64 GiB in 1 GiB pieces, untouched: the kernel's overcommit heuristic refuses a single
        # 64 GiB request by itself, but grants these; only the sandbox's memory limit stops them.
        "allocate_64_gib": ("  for (int i = 0; i < 64; ++i) {\n"
                            "    void* volatile p = std::malloc(std::size_t(1) << 30);\n"
                            "    if (p == nullptr) std::abort();\n  }\n  return 42;\n}\n",
                            "runtime_error"),
        "huge_output": ("  for (;;) std::fputs(\"spam spam spam spam spam spam spam\\n\", stdout);"
                        "\n}\n", "runtime_error"),
        "network": ("  int s = socket(AF_INET, SOCK_STREAM, 0);\n  sockaddr_in a{};\n"
                    "  a.sin_family = AF_INET;\n"
                    f"  a.sin_port = htons({port});\n"
                    "  inet_pton(AF_INET, \"127.0.0.1\", &a.sin_addr);\n"
                    "  if (connect(s, (sockaddr*)&a, sizeof a) != 0) return 41;\n"
                    "  send(s, \"leak\", 4, 0);\n  return 42;\n}\n", "wrong_answer"),
        "write_outside": (f"  FILE* f = std::fopen(\"{outside}\", \"w\");\n  if (!f) return 41;\n"
                          "  std::fputs(\"escaped\", f);\n  std::fclose(f);\n  return 42;\n}\n",
                          "wrong_answer"),
        # the tool chain is attacked too (a completion's #include is not compiled: a directive):
        # the assembler, which runs in the sandbox as well, given an endless file to copy into
        # the program, and a secret
        "incbin_dev_zero": ("  asm(\".incbin \\\"/dev/zero\\\"\");\n  return 42;\n}\n", "compile_error"),
        "incbin_secret": ("  asm(\".incbin \\\"/etc/shadow\\\"\");\n  return 42;\n}\n", "compile_error"),
        # the harness's pass marker, looked for in the program's own binary and printed
        "forged_marker": (
            "  static char bin[1 << 22];\n  FILE* f = std::fopen(\"/proc/self/exe\", \"rb\");\n"
            "  std::size_t n = f ? std::fread(bin, 1, sizeof bin, f) : 0;\n"
            "  const char* tag = \"xtrain-tests-passed-\";\n"
            "  for (std::size_t i = 0; i + 36 <= n; ++i) {\n"
            "    bool hit = true;\n"
            "    for (int j = 0; j < 36 && hit; ++j) {\n"
            "      char c = bin[i + j];\n"
            "      hit = j < 20 ? c == tag[j] : (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f');\n"
            "    }\n"
            "    if (hit) {\n      std::printf(\"\\n%.36s\\n\", bin + i);\n      std::fflush(stdout);\n"
            "      std::_Exit(0);\n    }\n  }\n  return 41;\n}\n", "wrong_answer"),
        # the root and /dev read-only; /tmp and /dev/shm writable, on the session dir's disk (as
        # /box is), not in RAM: a tmpfs there (bwrap's root is one) would let one program fill
        # the host's memory
        "own_tmp_read_only_dev": (
            "  if (std::fopen(\"/dev/made-up\", \"w\") != nullptr) return 41;\n"
            "  if (std::fopen(\"/made-up\", \"w\") != nullptr) return 41;\n"
            "  if (mkdir(\"/etc/made-up\", 0700) == 0) return 41;\n"
            "  struct stat box, tmp, shm;\n"
            "  if (stat(\"/box\", &box) || stat(\"/tmp\", &tmp) ||"
            " stat(\"/dev/shm\", &shm)) return 41;\n"
            "  if (tmp.st_dev != box.st_dev || shm.st_dev != box.st_dev)"
            " return 41;\n"
            "  if (!std::fopen(\"/tmp/x\", \"w\") ||"
            " !std::fopen(\"/dev/shm/x\", \"w\")) return 41;\n"
            "  return 42;\n}\n", "passed"),
        # nested deeper than Python's recursion limit: its dir must still be deleted
        "deep_dirs": ("  for (int d = 0; d < 3000; ++d)\n"
                      "    if (mkdir(\"d\", 0700) != 0 || chdir(\"d\") != 0) return 41;\n"
                      "  return 42;\n}\n", "passed"),
        # A daemon that leaves the process group: the program itself passes, the daemon must
        # still be gone afterwards.
        "escaping_daemon": ("  if (fork() == 0) {\n    setsid();\n"
                            "    if (fork() == 0) for (;;) pause();\n    _exit(0);\n  }\n"
                            "  return 42;\n}\n", "passed"),
        # a daemon that changes its pid every millisecond (forks, and the parent leaves): a
        # scan of /proc lists the one it then finds gone, never the child it left
        "pid_hopping_daemon": ("  if (fork() == 0) {\n    setsid();\n    for (;;) {\n"
                               "      usleep(1000);\n      if (fork() > 0) _exit(0);\n    }\n"
                               "  }\n  return 42;\n}\n", "passed"),
        # a user namespace of its own would open more of the kernel to it (bubblewrap 0.8+, as
        # .ci/system-tools installs it here, forbids one)
        "nested_user_namespace": ("  return unshare(CLONE_NEWUSER) == 0 ? 41 : 42;\n}\n", "passed"),
        # first in line for the OOM killer: a sample, not the training process beside it
        "oom_score_first": (
            "  FILE* f = std::fopen(\"/proc/self/oom_score_adj\", \"r\");\n  int adj = 0;\n"
            "  if (f) std::fscanf(f, \"%d\", &adj);\n  return adj == 1000 ? 42 : adj;\n}\n",
            "passed"),
        # a daemon whose leader thread exits while another runs on: /proc shows the process as a
        # zombie (its leader's state), yet it runs
        "daemon_behind_a_zombie_leader": (
            "  if (fork() == 0) {\n    setsid();\n    pthread_t t;\n"
            "    pthread_create(&t, nullptr, [](void*) -> void* { for (;;) pause(); }, nullptr);\n"
            "    pthread_exit(nullptr);\n  }\n  usleep(200000);\n  return 42;\n}\n", "passed"),
    }


def sandbox_processes() -> list[str]:
    """Live processes of a sandbox uid, or descendants of this test process: none may outlive
    an evaluation. Zombies (every thread in state Z) are left out: nothing runs in them, and this
    machine's init collects orphans' exit status only every few seconds. Under pytest-xdist the other
    workers (this process's siblings) may be evaluating too: their programs are theirs."""
    uids, parent, owner, stat_line, found = set(uid_range()), {}, {}, {}, []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            text = Path(f"/proc/{entry.name}/stat").read_text()
            uid = entry.stat().st_uid
        except OSError:
            continue  # exited while scanning
        ppid = text.rsplit(")", 1)[1].split()[1]
        if _runs(entry.name):
            pid = int(entry.name)
            parent[pid], owner[pid], stat_line[pid] = int(ppid), uid, text
    workers = {pid for pid, ppid in parent.items() if ppid == os.getppid()} \
        if os.environ.get("PYTEST_XDIST_WORKER") else {os.getpid()}
    for pid in parent:
        ancestor = parent.get(pid)
        while ancestor and ancestor not in workers:
            ancestor = parent.get(ancestor)
        if ancestor == os.getpid():
            found.append(f"{pid}: child of the test process")
        elif not ancestor and owner[pid] in uids:  # reached init, or a parent that is gone
            found.append(f"{pid} (uid {owner[pid]}): {stat_line[pid][:80]}")
    return found


def _runs(pid: str) -> bool:
    """Whether any thread of ``pid`` is other than a zombie (a process whose leader thread exited
    shows the leader's state Z while its other threads run)."""
    try:
        return any(Path(f"/proc/{pid}/task/{t}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
                   for t in os.listdir(f"/proc/{pid}/task"))
    except OSError:
        return False  # exited while scanning


def judge(completions: dict[str, tuple[str, str]], cancel=None, **overrides):
    """``cancel`` (a threading.Event) set: the evaluation is called off (scores None)."""
    cfg = EvalConfig(**{"run_timeout_s": RUN_TIMEOUT, "workers": 2, **overrides})
    # The evaluation's temp dirs go to a dir of its own, where any left behind are its: another
    # pytest-xdist worker may be evaluating at the same time.
    tmp = Path(tempfile.mkdtemp(prefix="xtrain-test-tmp-"))
    tmp.chmod(0o755)  # as /tmp: the sandbox uid passes through it (eval.sandbox=rlimits)
    # Earlier tests may leave long-lived helpers of this process (multiprocessing's resource
    # tracker, an emulator): only what appears during the evaluation counts.
    processes_before = set(sandbox_processes())
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(tempfile, "tempdir", str(tmp))
            start = time.perf_counter()
            try:
                scores, records = evaluate(
                    [PROBLEM], {PROBLEM.id: [c for c, _ in completions.values()]}, cfg, cancel=cancel)
            except Cancelled:
                scores, records = None, []
            elapsed = time.perf_counter() - start
        new_dirs = {p.name for p in tmp.iterdir()}
    finally:
        subprocess.run(["rm", "-rf", str(tmp)], check=True)  # deep_dirs nests past rmtree's recursion
    return {"records": dict(zip(completions, records)), "elapsed": elapsed, "scores": scores,
            "processes": sorted(set(sandbox_processes()) - processes_before), "new_dirs": new_dirs}


@pytest.fixture(scope="module")
def hostile():
    """Every hostile program judged once under bubblewrap (the default sandbox), with a
    listening loopback socket and a world-writable dir outside the sandbox as bait."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    listener.setblocking(False)
    bait_dir = Path(tempfile.mkdtemp(prefix="xtrain-test-bait-"))
    bait_dir.chmod(0o777)  # writable by any uid: only the sandbox stands in the way
    outside = bait_dir / f"escaped-{secrets.token_hex(4)}"
    programs = hostile_programs(listener.getsockname()[1], str(outside))
    try:
        result = judge(programs, sandbox="bwrap")
        try:
            connection, _ = listener.accept()
            result["received"] = connection.recv(100) or b"(connected)"
        except BlockingIOError:
            result["received"] = b""
        result["outside_exists"] = outside.exists()
        yield programs, result
    finally:
        listener.close()
        shutil.rmtree(bait_dir, ignore_errors=True)


@pytest.mark.parametrize("kind", list(hostile_programs(0, "/x")))
def test_hostile_program_scored_as_its_failure_within_limits(hostile, kind):
    programs, result = hostile
    record = result["records"][kind]
    assert record["outcome"] == programs[kind][1], record
    signals = {"allocate_64_gib": 128 + signal.SIGABRT, "huge_output": 128 + signal.SIGXFSZ}
    if kind in signals:  # died of the limit meant for it
        assert record["exit_code"] == signals[kind], record
    if record["run_s"] is not None:
        assert record["run_s"] < RUN_TIMEOUT + 1.5, record  # killed on time, not waited out
    if record["compile_s"] is not None:  # (None: a directive, not compiled)
        assert record["compile_s"] < 30


def test_hostile_batch_leaves_nothing_behind(hostile):
    _, result = hostile
    assert result["processes"] == []
    assert result["new_dirs"] == set()


def test_network_connection_reaches_nothing(hostile):
    _, result = hostile
    assert result["received"] == b""
    assert "answer 41" in result["records"]["network"]["test_output"]  # connect() failed


def test_compiler_cannot_read_secrets(hostile):
    _, result = hostile
    message = result["records"]["incbin_secret"]["compiler_message"]
    assert "file not found: /etc/shadow" in message and "root:" not in message


def test_write_outside_its_dir_does_not_appear(hostile):
    _, result = hostile
    assert not result["outside_exists"]
    assert "answer 41" in result["records"]["write_outside"]["test_output"]  # fopen() failed


def test_fallback_without_bubblewrap_still_contains_programs(capfd, monkeypatch):
    """eval.sandbox=rlimits (machines without namespaces): resource limits, the process group
    kill, a private uid and its sweep still hold; the warning names what is missing."""
    monkeypatch.setattr(sandbox_module, "_warned", [])
    root_only = Path(tempfile.mkdtemp(prefix="xtrain-test-rootonly-"))
    root_only.chmod(0o755)  # root may write here, the sandbox uid may not
    programs = {k: v for k, v in hostile_programs(0, str(root_only / "escaped")).items()
                if k in ("infinite_loop", "fork_bomb", "allocate_64_gib", "huge_output",
                         "escaping_daemon", "pid_hopping_daemon",
                         "daemon_behind_a_zombie_leader", "write_outside",
                         "reference")}
    try:
        result = judge(programs, sandbox="rlimits")
        assert not (root_only / "escaped").exists()
    finally:
        shutil.rmtree(root_only)
    for kind, (_, expected) in programs.items():
        record = result["records"][kind]
        assert record["outcome"] == expected, record
        if record["run_s"] is not None:
            assert record["run_s"] < RUN_TIMEOUT + 1.5, record
    assert result["processes"] == []
    assert result["new_dirs"] == set()
    warning = capfd.readouterr().err
    assert "C++ eval sandbox without bubblewrap" in warning
    assert "no read-only filesystem view" in warning and "no PID namespace" in warning


def _path_without_bwrap(tmp_path) -> str:
    """A PATH holding every tool the sandbox uses except bwrap (a machine without bubblewrap)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("prlimit", "unshare", "kill", "true", "g++"):
        (bin_dir / tool).symlink_to(shutil.which(tool))
    bin_dir.chmod(0o755)
    return str(bin_dir)


def test_required_bubblewrap_missing_is_a_config_error(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", _path_without_bwrap(tmp_path))
    with pytest.raises(ConfigError, match="eval.sandbox=bwrap: bwrap not found"):
        Sandbox(EvalConfig(sandbox="bwrap"), 1)


def test_auto_without_bubblewrap_falls_back_and_says_why(tmp_path, monkeypatch, capfd):
    monkeypatch.setenv("PATH", _path_without_bwrap(tmp_path))
    monkeypatch.setattr(sandbox_module, "_warned", [])
    box = Sandbox(EvalConfig(sandbox="auto"), 1)
    box.close()
    assert box.mode == "rlimits"
    assert "bwrap not found (sudo apt-get install bubblewrap)" in capfd.readouterr().err


def test_a_bubblewrap_that_cannot_disable_user_namespaces_still_sandboxes(monkeypatch):
    """Forbidding nested user namespaces needs one of bwrap's own: a bwrap refusing that (a
    setuid one with none, stood in for by a wrapper of the real one) runs without it."""
    bin_dir = Path(tempfile.mkdtemp(prefix="xtrain-test-bwrap-"))
    try:
        wrapper = bin_dir / "bwrap"
        wrapper.write_text("#!/bin/sh\nfor a in \"$@\"; do [ \"$a\" = --disable-userns ] && "
                           "{ echo 'bwrap: no user namespace' >&2; exit 1; }; done\n"
                           f"exec {shutil.which('bwrap')} \"$@\"\n")
        wrapper.chmod(0o755)
        bin_dir.chmod(0o755)  # the sandbox uid runs it
        monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
        box = Sandbox(EvalConfig(sandbox="bwrap"), 1)
        box.close()
    finally:
        shutil.rmtree(bin_dir)
    assert box.mode == "bwrap" and box._bwrap[0] == str(wrapper)
    assert not set(sandbox_module.NO_USERNS) & set(box._bwrap)
    real = Sandbox(EvalConfig(sandbox="bwrap"), 1)  # this machine's bubblewrap 0.8 takes it
    real.close()
    assert set(sandbox_module.NO_USERNS) <= set(real._bwrap)


def test_without_root_and_bubblewrap_auto_refuses_and_rlimits_says_what_it_risks(
        tmp_path, monkeypatch, capfd):
    """Without root the fallback has no private uid: programs would run as this user, so auto
    refuses (at start, naming the ways out); an explicit rlimits runs and says so. Tests run as
    root here: geteuid stands in for a non-root xtrain."""
    monkeypatch.setenv("PATH", _path_without_bwrap(tmp_path))
    monkeypatch.setattr(sandbox_module, "_warned", [])
    monkeypatch.setattr(sandbox_module.os, "geteuid", lambda: 1000)
    with pytest.raises(ConfigError, match=r"^eval.sandbox=auto: bwrap not found .* without root "
                                          r".*make bubblewrap work here.*eval.sandbox=rlimits"):
        Sandbox(EvalConfig(sandbox="auto"), 1)
    box = Sandbox(EvalConfig(sandbox="rlimits"), 1)
    box.close()
    assert box.mode == "rlimits" and box._free == [None]  # no uid of its own
    err = capfd.readouterr().err
    assert "a daemon it starts may outlive it, running as this user" in err
    assert "the program may read this process's environment (secrets)" in err  # unshare or not


def test_without_root_the_process_limit_leaves_room_for_the_users_threads():
    """Without root a program shares this user's process limit, which the kernel counts in
    threads, so the limit set is the user's threads plus eval's processes: counted in processes,
    64 threads of xtrain's own left bubblewrap unable to start. Tests run as root: a forked child
    switched to an unused uid is the non-root xtrain (no exec: the interpreter lives in root's
    home), with 64 threads besides its main one, running a program in a bubblewrap session."""
    if os.geteuid() != 0:
        pytest.skip("standing in for another uid needs root (as the uid slots do)")
    uid = uid_range()[0] - 9
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child only switches uid, starts threads and makes the sandbox
        code = 1
        try:
            os.close(read)
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            held = threading.Event()
            for _ in range(64):
                threading.Thread(target=held.wait, daemon=True).start()
            cfg = EvalConfig(sandbox="bwrap")
            sandbox = Sandbox(cfg, 1)
            with sandbox.session() as session:  # under the process limit, unlike the probe
                ran = session.run(["/usr/bin/true"], limits_for(cfg, compile=False))
            sandbox.close()
            assert ran.returncode == 0, ran.stderr
            code = 0
        except BaseException as e:  # noqa: BLE001  (said to the test through the pipe)
            os.write(write, f"{type(e).__name__}: {e}".encode()[-3000:])
        finally:
            os._exit(code)
    os.close(write)
    with os.fdopen(read, "rb") as said:
        error = said.read().decode()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, error


def test_a_session_dir_its_program_locked_is_deleted_without_root():
    """Without root, a dir the program took every permission from is given them back and
    deleted. Tests run as root: a forked child switched to an unused uid is the non-root xtrain."""
    if os.geteuid() != 0:
        pytest.skip("standing in for another uid needs root (as the uid slots do)")
    uid = uid_range()[0] - 7
    base = Path(tempfile.mkdtemp(prefix="xtrain-test-remove-"))
    session = base / "session"
    locked = session / "box" / "locked"
    locked.mkdir(parents=True)
    (locked / "file").write_text("x")
    for path in (base, session, session / "box", locked, locked / "file"):
        os.chown(path, uid, uid)
    locked.chmod(0)
    try:
        pid = os.fork()
        if pid == 0:  # the child only switches uid and deletes: no pytest code runs there
            code = 1
            try:
                os.setgid(uid)
                os.setuid(uid)
                sandbox_module._remove(session)
                code = 0
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert not session.exists()
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_a_cancel_ends_an_evaluation_that_is_judging_and_leaves_nothing_behind():
    """Twelve samples spinning to their 10 s limit, two at a time, would take a minute; called
    off 1 s in (the run is stopping), the running programs are killed and the rest skipped."""
    cancel = threading.Event()
    timer = threading.Timer(1.0, cancel.set)
    timer.start()
    try:
        result = judge({f"spin{i}": ("  for (;;) {}\n}\n", "timeout") for i in range(12)},
                       cancel=cancel, run_timeout_s=10.0, sandbox="bwrap")
    finally:
        timer.cancel()
    assert result["scores"] is None  # Cancelled
    assert result["elapsed"] < 6, result["elapsed"]  # not a running sample's 10 s
    assert result["processes"] == [] and result["new_dirs"] == set()


@pytest.mark.parametrize("mode", ["bwrap", "rlimits"])
def test_a_subreapers_evaluation_reaps_the_orphans_it_is_given(mode, tmp_path):
    """A container's entry point (PID 1), or a subreaper, becomes the parent of a sandbox's
    orphans (bubblewrap's own, a program's children): left as zombies they would count against
    the slot's process limit, and the slot's next compile could not fork (every later sample a
    compile error). One slot, eight correct samples, each leaving four children behind."""
    if os.geteuid() != 0:
        pytest.skip("uid slots are only claimed when xtrain runs as root")
    leaves_children = ("  for (int i = 0; i < 4; ++i) if (fork() == 0) { usleep(50000); _exit(0); }\n"
                       "  return 42;\n}\n")
    code = ("import ctypes, json, sys\n"
            "assert ctypes.CDLL(None).prctl(36, 1, 0, 0, 0) == 0  # PR_SET_CHILD_SUBREAPER\n"
            "from xtrain.evals import EvalConfig, evaluate\n"
            "from tests.test_evals_sandbox import PROBLEM\n"
            f"cfg = EvalConfig(workers=1, max_processes=8, sandbox={mode!r})\n"
            f"_, records = evaluate([PROBLEM], {{PROBLEM.id: [{leaves_children!r}] * 8}}, cfg)\n"
            "print(json.dumps([r['outcome'] for r in records]))\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parent.parent,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip().splitlines()[-1] == '["passed", "passed", "passed", "passed", "passed", ' \
                                               '"passed", "passed", "passed"]', r.stdout + r.stderr[-2000:]


def test_uids_nobody_and_uint16_minus_one_are_never_sandbox_uids(monkeypatch):
    """A rootless container's uid map ends at 65536: the top of the range is not 65535 there."""
    monkeypatch.setattr(uids_module, "_top_of_uid_map", lambda: 65536)
    uids = uid_range()
    assert len(uids) == uids_module._UID_CANDIDATES and max(uids) == 65533
    assert not {65534, 65535} & set(uids)


def test_uid_locks_go_to_the_temp_dir_where_run_is_read_only(monkeypatch, tmp_path):
    """A container with a read-only root has no writable /run; its temp dir still takes them.
    (Root writes through file modes: a /run that cannot take the dir is one that does not exist.)"""
    if os.geteuid() != 0:
        pytest.skip("uid slots are only claimed when xtrain runs as root")
    monkeypatch.setattr(uids_module, "_LOCK_DIRS", (tmp_path / "no-run", tmp_path))
    assert uids_module.lock_dir() == tmp_path / uids_module.LOCKS_NAME
    box = Sandbox(EvalConfig(), 1)
    box.close()
    assert str(box._free[0]) in [p.name for p in (tmp_path / uids_module.LOCKS_NAME).iterdir()]


def test_uid_slots_are_private_and_released():
    """Two sandboxes (two evaluations at once) never share a uid; closing releases them."""
    if os.geteuid() != 0:
        pytest.skip("uid slots are only claimed when xtrain runs as root")
    import fcntl

    first, second = Sandbox(EvalConfig(), 2), Sandbox(EvalConfig(), 2)
    try:
        assert len(set(first._free) | set(second._free)) == 4
        assert set(first._free) <= set(uid_range())
    finally:
        first.close()
        second.close()
    for uid in first._free + second._free:  # each one's lock free for the next sandbox
        fd = os.open(uids_module.lock_dir() / str(uid), os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        finally:
            os.close(fd)


def test_session_dir_is_private_to_its_uid():
    box = Sandbox(EvalConfig(), 1)
    try:
        with box.session() as session:
            mode = stat.S_IMODE(session.box.stat().st_mode)
            root_mode = stat.S_IMODE(session.root.stat().st_mode)
            owner = session.box.stat().st_uid
            path = session.root
        assert mode == 0o700 and root_mode == 0o711
        assert owner == (session.uid if os.geteuid() == 0 else os.getuid())
        assert not path.exists()
    finally:
        box.close()


def test_the_sandboxs_orphans_are_reaped_under_an_init_that_reaps_nothing(tmp_path):
    """bubblewrap exits once its program has, before the init of its PID namespace does, and a
    program past its time has bubblewrap killed first: that init was left to PID 1. A
    container's PID 1 is often a process that never reaps (tail -f /dev/null, sleep infinity):
    its zombies counted against the uid's process limit, and after a few programs the slot's
    compiles could not fork (scored compile errors). Here PID 1 of a new PID namespace waits for
    its own child only; the limit is 6 processes."""
    if os.geteuid() != 0:
        pytest.skip("uid slots, and a PID namespace of its own, need root")
    child = tmp_path / "evaluate.py"
    child.write_text(
        "from xtrain.evals import EvalConfig\n"
        "from xtrain.evals.harness import _compile, find_gxx\n"
        "from xtrain.evals.sandbox import Sandbox, limits_for\n"
        "cfg = EvalConfig(run_timeout_s=0.3, max_processes=6)\n"
        "box = Sandbox(cfg, 1)\n"
        "for program in ['exit 0'] * 3 + ['while :; do :; done'] * 3:\n"
        "    with box.session() as session:\n"
        "        ran = session.run(['/bin/sh', '-c', program], limits_for(cfg, compile=False))\n"
        "        assert ran.timed_out == ('while' in program), ran\n"
        "with box.session() as session:\n"
        "    session.write('main.cpp', 'int main() { return 0; }\\n')\n"
        "    built = _compile(session, find_gxx(cfg), cfg)\n"
        "print('compile', built.returncode, built.stderr.strip()[-200:])\n"
        "box.close()\n")
    init = "import subprocess, sys; sys.exit(subprocess.run([sys.executable, sys.argv[1]]).returncode)"
    r = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-c", init,
                        str(child)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "compile 0 " in r.stdout, (r.stdout + r.stderr)[-3000:]
