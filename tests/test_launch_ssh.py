"""The launchers' mechanisms against a real OpenSSH server on loopback (tests/sshd.py): connection
retries, host keys, code sync, the venv install (a real package from PyPI), and remote job
control. Stood in for: apt-get and sudo (scripts that record their calls: the tests do not
install system packages) and a DNS answer (recorded: no resolver is reachable here)."""

from __future__ import annotations

import fcntl
import hashlib
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from tests.sshd import (BASE_PYTHON, HOSTS, git_tree, keygen, live_group, remote,  # noqa: F401
                        ssh_processes, sshd)
from xtrain.errors import ConfigError
from xtrain.launcher.config import LauncherConfig
from xtrain.launcher import env
from xtrain.launcher import worker as worker_module
from xtrain.launcher.env import EnvSpec, ensure_env, system_tools_script
from xtrain.launcher.job import STATE_SH, JobState, RemoteJob
from xtrain.launcher.runner import LaunchError, Result, Runner, VmUnavailable, parallel
from xtrain.launcher.ssh import HOST_KEY_CHANGED, Ssh
from xtrain.launcher.sync import code_files, sync
from xtrain.launcher.targets import Target
from xtrain.launcher.worker import Worker, launch_lock


def make_worker(remote, tmp_path, host=HOSTS[0], job="unit", **fields):
    """A probed worker whose remote root is this test's own directory."""
    fields.setdefault("remote_dir", str(tmp_path / "hosts") + "/{host}")
    cfg = OmegaConf.structured(LauncherConfig(**remote.launcher_fields(hosts=[host], **fields)))
    runner, messages = Runner(), []
    ssh = Ssh(cfg, runner, messages.append)
    ssh.check_local()
    worker = Worker(Target(0, host, host), ssh, cfg.remote_dir, cfg.venv)
    worker.probe(job)
    return worker, runner, messages


def sync_xtrain(worker, runner):
    root = Path(__file__).resolve().parent.parent
    sync(worker.ssh, worker.host, root, code_files(root, runner), worker.code)


@pytest.mark.parametrize("spaced", [False, True], ids=["plain", "spaces"])
def test_first_contact_records_the_host_key_in_xtrains_known_hosts(remote, tmp_path, spaced,
                                                                     monkeypatch, request):
    """Also with spaces in the paths ssh is given in its options: ssh splits such a value into
    words (known_hosts became two files, neither written; a socket's path was refused)."""
    known = tmp_path / ("k  h's" if spaced else "kh") / "known_hosts"
    if spaced:  # the shared connection's socket, under the temp dir
        sockets = tempfile.mkdtemp(prefix="xt  s-", dir="/tmp")  # (short: a socket's path is)
        request.addfinalizer(lambda: shutil.rmtree(sockets, ignore_errors=True))
        monkeypatch.setattr(tempfile, "tempdir", sockets)
    worker, _, _ = make_worker(remote, tmp_path, known_hosts=str(known))
    if spaced:
        assert any(Path(sockets).rglob("*")), "no shared connection under the spaced temp dir"
    server_key = Path(f"{remote.sshd.host_key}.pub").read_text().split()[1]
    assert f"[{HOSTS[0]}]:{remote.sshd.port} ssh-ed25519 {server_key}" in known.read_text()
    assert worker.root == str(tmp_path / "hosts" / HOSTS[0])


@pytest.mark.parametrize("public_file", [True, False], ids=["pub-file", "derived"])
def test_the_key_a_new_vm_gets_is_the_login_users_public_key(tmp_path, public_file):
    key = keygen(tmp_path / "id")
    algorithm, body = Path(f"{key}.pub").read_text().split()[:2]
    if not public_file:
        Path(f"{key}.pub").unlink()  # ssh-keygen -y derives it from the private key
    cfg = OmegaConf.structured(LauncherConfig(identity_file=str(key), user="alice"))
    line = Ssh(cfg, Runner()).authorized_key()
    assert line.split()[:2] == [f"alice:{algorithm}", body]


def test_a_changed_host_key_is_refused_and_rekeyed_only_on_request(remote, tmp_path):
    known = tmp_path / "known_hosts"
    other = Path(f"{keygen(tmp_path / 'other_key')}.pub").read_text().split()
    entry = f"[{HOSTS[0]}]:{remote.sshd.port}"
    known.write_text(f"{entry} {other[0]} {other[1]}\n")
    with pytest.raises(ConfigError) as e:
        make_worker(remote, tmp_path, known_hosts=str(known))
    assert f"{entry}: host key changed" in str(e.value) and "hydra.launcher.rekey=true" in str(e.value)
    assert not (tmp_path / "hosts").exists()  # refused before anything was created or copied
    worker, runner, messages = make_worker(remote, tmp_path, known_hosts=str(known), rekey=True)
    server_key = Path(f"{remote.sshd.host_key}.pub").read_text().split()[1]
    assert server_key in known.read_text() and other[1] not in known.read_text()
    assert "rekey" in runner.labels() and any("old key removed" in m for m in messages)


def test_the_hosts_of_a_pod_rekeyed_at_once_all_lose_their_old_keys(tmp_path):
    """A recreated pod's workers are probed in parallel and all find their key changed. Each
    removal by ssh-keygen rewrote known_hosts whole, so removals made at once lost one another
    (and a worker was refused with the advice to set the rekey=true it had). Real ssh-keygen on
    a known_hosts of 12 hosts; no connection is needed to remove a key."""
    known = tmp_path / "known_hosts"
    algorithm, body = Path(f"{keygen(tmp_path / 'old_key')}.pub").read_text().split()[:2]
    hosts = [f"127.0.0.{i}" for i in range(10, 22)]
    kept = f"[127.0.0.99]:2222 {algorithm} {body}\n"
    known.write_text("".join(f"[{h}]:2222 {algorithm} {body}\n" for h in hosts) + kept)
    cfg = OmegaConf.structured(LauncherConfig(known_hosts=str(known), port=2222, rekey=True))
    ssh = Ssh(cfg, Runner())
    changed = Result(255, "", f"@@@ WARNING: {HOST_KEY_CHANGED}! @@@\n")
    assert parallel(lambda h: ssh.connection_failure(h, changed), hosts) == ["rekeyed"] * len(hosts)
    assert known.read_text() == kept


def test_shared_connections_work_under_a_temp_dir_too_long_for_their_sockets(remote, tmp_path,
                                                                           monkeypatch):
    """A long temp dir (macOS's per-user $TMPDIR is about 50 characters) left no room for ssh's
    control socket: every call failed ("ControlPath too long"). The sockets then go under /tmp."""
    long_tmp = tmp_path / ("t" * 60)
    long_tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(long_tmp))
    worker, _, _ = make_worker(remote, tmp_path)
    assert worker.run("echo reached\n", "echo").stdout == "reached\n"
    assert not list(long_tmp.iterdir())


def test_an_unreachable_host_is_a_clear_error_after_the_retries(remote, tmp_path):
    t0 = time.perf_counter()
    with pytest.raises(LaunchError) as e:  # nothing listens on 127.0.0.4
        make_worker(remote, tmp_path, host="127.0.0.4", retries=2, backoff_s=0.3)
    assert f"127.0.0.4:{remote.sshd.port} unreachable after 3 attempts" in str(e.value)
    assert "Connection refused" in str(e.value)
    assert time.perf_counter() - t0 >= 0.3 + 0.6  # backoff 0.3 s, then doubled


def test_a_remote_command_that_outlasts_its_timeout_is_not_retried(remote, tmp_path):
    """A command that ran past its time (a stop whose process group will not die) reached the
    host: it is an error at once, not an unreachable host to try again with backoff."""
    worker, runner, _ = make_worker(remote, tmp_path, retries=2, backoff_s=0.3)
    with pytest.raises(LaunchError, match=r"^127\.0\.0\.2: the remote command did not end: timed "
                                          r"out after 1 s \(not retried: it ran\)$"):
        worker.run("sleep 30\n", "slow", timeout=1)
    assert runner.labels().count("slow") == 1
    # an rsync past its time is run again (it goes on where it stopped)
    timed_out = Result(-1, "", "\ntimed out after 1800 s")
    assert worker.ssh.connection_failure(HOSTS[0], timed_out, rerunnable=True) == \
        "timed out after 1800 s"


def test_a_host_name_the_resolver_does_not_know_is_refused_at_once(tmp_path):
    """ssh's answer for a name DNS says does not exist, recorded (a real lookup of a made-up
    name may instead time out where no resolver answers, which is retried): refused on the first
    attempt, not retried; a resolver that did not answer is retried."""
    cfg = OmegaConf.structured(LauncherConfig(hosts=["nohost.invalid"], retries=3, backoff_s=0.01))
    ssh = Ssh(cfg, Runner(), print)
    answers = iter([Result(255, "", "ssh: Could not resolve hostname nohost.invalid: Temporary "
                                    "failure in name resolution\r\n"),
                    Result(255, "", "ssh: Could not resolve hostname nohost.invalid: Name or "
                                    "service not known\r\n")])
    calls = []
    with pytest.raises(ConfigError, match="nohost.invalid: no such host .*Name or service not "
                                          "known.*hydra.launcher.hosts"):
        ssh.retrying("nohost.invalid", lambda: calls.append(1) or next(answers))
    assert len(calls) == 2  # the unanswered lookup retried once, the unknown name not at all


def test_a_shared_connection_dir_that_is_not_this_users_alone_is_refused(tmp_path, monkeypatch,
                                                                         request):
    """ssh's shared connections (ControlMaster) listen under the temp dir at a path anyone can
    work out, and ssh hands a session's stdin (secrets included) to whatever socket it finds there:
    a socket dir or its parent that another user owns or may write to, or a symlink, is refused
    before any connection."""
    short = Path(tempfile.mkdtemp(prefix="x", dir="/tmp"))  # (tmp_path: too long for a socket)
    request.addfinalizer(lambda: shutil.rmtree(short))
    monkeypatch.setattr(tempfile, "tempdir", str(short))
    cfg = OmegaConf.structured(LauncherConfig(hosts=["h"], known_hosts=str(tmp_path / "kh")))
    ssh = Ssh(cfg, Runner(), print)

    def control_dir() -> Path:
        options = dict(o[2:].split("=", 1) for o in ssh.options() if o.startswith("-o"))
        return Path(options["ControlPath"]).parent

    base, sockets = short / f"xtrain-ssh-{os.getuid()}", control_dir()
    assert sockets.parent == base and sockets.stat().st_mode & 0o777 == 0o700
    refused = "the directory of ssh.s shared connections, is not this user.s alone .*multiplex=false"
    for where, mode in ((base, 0o777), (base, 0o775), (sockets, 0o750), (sockets, 0o701)):
        where.chmod(mode)
        with pytest.raises(ConfigError, match=f"{where}, {refused}"):
            control_dir()
        where.chmod(0o755 if where == base else 0o700)
    assert control_dir() == sockets  # as it was made
    shutil.rmtree(base)
    (tmp_path / "theirs").mkdir(mode=0o700)
    base.symlink_to(tmp_path / "theirs")
    with pytest.raises(ConfigError, match=f"{base}, {refused}"):
        control_dir()
    base.unlink()
    real_uid = os.getuid()  # another user's dirs: the same dirs seen as another uid
    control_dir()
    monkeypatch.setattr(os, "getuid", lambda: real_uid + 1)
    (tmp_path / f"xtrain-ssh-{real_uid + 1}").mkdir(mode=0o755)
    with pytest.raises(ConfigError, match=f"xtrain-ssh-{real_uid + 1}, {refused}"):
        control_dir()


def test_sync_is_incremental_and_mirrors_deletions(remote, tmp_path):
    repo = git_tree(tmp_path / "repo")
    worker, runner, _ = make_worker(remote, tmp_path)
    dest = Path(worker.code)
    sent = sync(worker.ssh, worker.host, repo, code_files(repo, runner), worker.code)
    assert sorted(sent) == [".gitignore", "new_untracked.py", "pkg/mod.py"]
    assert sorted(str(p.relative_to(dest)) for p in dest.rglob("*") if p.is_file()) == sent
    (dest / "pkg" / "__pycache__").mkdir()
    (dest / "pkg" / "__pycache__" / "mod.cpython-311.pyc").write_bytes(b"cache")
    assert sync(worker.ssh, worker.host, repo, code_files(repo, runner), worker.code) == []
    (repo / "new_untracked.py").unlink()
    time.sleep(1.1)  # rsync compares mtimes in seconds
    (repo / "pkg" / "mod.py").write_text("x = 2\n")
    assert sync(worker.ssh, worker.host, repo, code_files(repo, runner), worker.code) == ["pkg/mod.py"]
    assert (dest / "pkg" / "mod.py").read_text() == "x = 2\n"
    assert not (dest / "new_untracked.py").exists()  # deleted locally, deleted there
    assert (dest / "pkg" / "__pycache__" / "mod.cpython-311.pyc").exists()  # the worker's own cache


def test_sync_copies_names_that_look_like_wildcards(remote, tmp_path):
    """rsync reads a filter rule with *, ? or [ as a wildcard: such names must still be copied
    (and a file they would match by accident must not be)."""
    repo = git_tree(tmp_path / "repo")
    names = ["pkg/data[1].py", "pkg/star*.py", "pkg/what?.py", "pkg/w[x]\\y.py", "pkg/x\\y.py"]
    for name in names:
        (repo / name).write_text("x = 1\n")
    worker, runner, _ = make_worker(remote, tmp_path)
    files = code_files(repo, runner)
    assert set(names) <= set(files)
    (repo / "pkg" / "data1.py").write_text("not listed\n")  # what data[1].py matches as a wildcard
    sync(worker.ssh, worker.host, repo, files, worker.code)
    arrived = {str(p.relative_to(worker.code)) for p in Path(worker.code).rglob("*") if p.is_file()}
    assert arrived == set(files)


def test_env_installs_pinned_packages_from_pypi_once(remote, tmp_path, monkeypatch):
    """A venv whose creation stopped short (no pip, as when the VM lacks ensurepip), a small
    pure-Python package from PyPI: the venv is made afresh, the package installed, verified,
    stamped; the same spec again installs nothing; a new pin installs again, and a system tool
    the worker lacks (one that exists nowhere) is named in what the install says; the venv is
    stamped all the same, and the next launch tries the tool alone again."""
    subprocess.run([str(BASE_PYTHON), "-m", "venv", "--without-pip", str(tmp_path / "fresh-venv")],
                   check=True)
    worker, runner, _ = make_worker(remote, tmp_path, venv=str(tmp_path / "fresh-venv"))
    sync_xtrain(worker, runner)  # the check runs the synced xtrain.launcher.envcheck
    spec = EnvSpec(str(BASE_PYTHON), ("six==1.16.0",))
    assert ensure_env(worker, spec, None) == "installed"
    python = tmp_path / "fresh-venv" / "bin" / "python"
    version = [str(python), "-c", "import six; print(six.__version__)"]
    assert subprocess.run(version, capture_output=True, text=True).stdout.strip() == "1.16.0"
    stamp = worker.probe("unit").stamp
    assert stamp == spec.stamp
    before = len(runner.calls)
    assert ensure_env(worker, spec, stamp) == "unchanged"
    assert len(runner.calls) == before  # not even a call
    newer = EnvSpec(str(BASE_PYTHON), ("six==1.17.0",))
    # (no apt-get either: where sudo needs no password, this machine's packages stay as they are)
    monkeypatch.setattr(env, "SYSTEM_TOOLS", {"xtrain-test-absent": "xtrain-test-absent-package"})
    monkeypatch.setattr(worker_module, "SYSTEM_TOOLS", env.SYSTEM_TOOLS)
    monkeypatch.setattr(env, "APT_GET", "xtrain-test-no-apt-get")
    warning = ("xtrain: warning: xtrain-test-absent is not on this VM, and no apt-get with "
               "passwordless sudo installs it: apt-get install xtrain-test-absent-package")
    state = ensure_env(worker, newer, stamp)
    assert state == f"installed; {warning}", state
    assert subprocess.run(version, capture_output=True, text=True).stdout.strip() == "1.17.0"
    probe = worker.probe("unit")
    assert probe.stamp == newer.stamp and probe.lacks == ["xtrain-test-absent"]
    assert ensure_env(worker, newer, probe.stamp, probe.lacks) == f"unchanged; {warning}"
    assert runner.labels().count("install") == 2 and runner.labels().count("system tools") == 1


def test_installs_into_one_venv_take_turns(remote, tmp_path):
    """A launch killed during its install leaves the remote install running (sshd does not
    signal a session without a terminal), and the next launch's install ran at the same time
    in the same venv. Two installs at once into a new venv: its making, a base Python that
    logs its calls and takes 2 s, happens once, the second install finding the venv made."""
    worker, runner, _ = make_worker(remote, tmp_path, venv=str(tmp_path / "venv"))
    sync_xtrain(worker, runner)  # the check runs the synced xtrain.launcher.envcheck
    calls, base = tmp_path / "calls", tmp_path / "bin" / "python3-logging"
    base.parent.mkdir()
    base.write_text(f'#!/bin/bash\nif [ "$1 $2" = "-m venv" ]; then echo "start $$" >> {calls}; '
                    f'sleep 2; fi\n{BASE_PYTHON} "$@"; rc=$?\n'
                    f'[ "$1 $2" != "-m venv" ] || echo "end $$" >> {calls}\nexit $rc\n')
    base.chmod(0o755)
    spec = EnvSpec(str(base), ("pip",), ("--no-index",))  # (already there: no download)
    assert parallel(lambda _: ensure_env(worker, spec, None), [0, 1]) == ["installed"] * 2
    made = calls.read_text().split()
    assert made[::2] == ["start", "end"] and made[1] == made[3], made


@pytest.mark.parametrize("case", ["present", "installed", "installed, no tool", "no sudo",
                                  "apt fails"])
def test_a_missing_system_tool_is_installed_from_apt_or_named(tmp_path, monkeypatch, case):
    """The install script's lines for SYSTEM_TOOLS, run by bash on a PATH of stand-ins: apt-get
    and sudo are fakes that record their arguments (this machine's packages are not the test's
    to change); a tool that cannot be installed is a warning, not a failed install."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "calls"
    tool = bin_dir / "xtrain-test-tool"  # what the package brings (in "installed")
    brings = f'printf "#!/bin/sh\\n" > {tool}; chmod +x {tool}; ' if case == "installed" else ""
    fakes = {"apt-get": f'echo "apt-get $*" >> {calls}; case " $* " in *" install "*) {brings}:;; '
                        'esac; [ "$XTRAIN_TEST_APT" = ok ]',
             "sudo": 'shift; [ "$1" = env ] && shift 2; "$@"'}  # -n [env VAR=...] command...
    if case == "present":
        fakes["xtrain-test-tool"] = "true"
    for name, body in fakes.items():
        if name == "sudo" and case == "no sudo":
            continue
        (bin_dir / name).write_text(f"#!/bin/bash\n{body}\n")
        (bin_dir / name).chmod(0o755)
    monkeypatch.setattr(env, "SYSTEM_TOOLS", {"xtrain-test-tool": "xtrain-test-package"})
    script = "set -e\n" + system_tools_script() + "echo done\n"
    ran = subprocess.run(["/bin/bash", "-c", script], capture_output=True, text=True,
                         env={"PATH": str(bin_dir),
                              "XTRAIN_TEST_APT": "fail" if case == "apt fails" else "ok"})
    assert ran.returncode == 0 and ran.stdout == "done\n", ran
    apt = calls.read_text().splitlines() if calls.exists() else []
    if case in ("present", "no sudo"):
        assert apt == []
    else:
        assert apt[0].endswith(" update") and (case == "apt fails" or apt[1].endswith(
            " install xtrain-test-package")), apt
    warning = {"present": None, "installed": None,
               "installed, no tool": "xtrain: warning: xtrain-test-tool is still not on this VM "
                                     "after installing xtrain-test-package",
               "no sudo": "xtrain: warning: xtrain-test-tool is not on this VM, and no apt-get "
                          "with passwordless sudo installs it: apt-get install xtrain-test-package",
               "apt fails": "xtrain: warning: installing xtrain-test-package failed"}[case]
    assert (warning in ran.stderr) if warning else "warning" not in ran.stderr, ran.stderr


def test_a_venv_another_python_made_is_made_afresh(remote, tmp_path):
    """base_python (or hardware.python) changed: the venv is made again by the new one, not
    reused with packages built for the old. The other Python is this one by another path (the
    only one sure to be here), which the venv records as its home all the same."""
    worker, runner, _ = make_worker(remote, tmp_path, venv=str(tmp_path / "venv"))
    sync_xtrain(worker, runner)  # the check runs the synced xtrain.launcher.envcheck
    assert ensure_env(worker, EnvSpec(str(BASE_PYTHON), ("six==1.16.0",)), None) == "installed"
    other = tmp_path / "other-bin" / BASE_PYTHON.name
    other.parent.mkdir()
    other.symlink_to(BASE_PYTHON)
    (tmp_path / "venv" / "left-by-the-old").write_text("")
    state = ensure_env(worker, EnvSpec(str(other), ("six==1.16.0",)), None)
    assert state == (f"installed; xtrain: warning: {tmp_path / 'venv'} was made by another "
                     f"Python: made afresh with {other}"), state
    assert f"home = {other.parent}\n" in (tmp_path / "venv" / "pyvenv.cfg").read_text()
    assert not (tmp_path / "venv" / "left-by-the-old").exists()
    (tmp_path / "venv" / "left-by-the-same").write_text("")  # a new pin, the same Python: kept
    assert ensure_env(worker, EnvSpec(str(other), ("six==1.17.0",)), None) == "installed"
    assert (tmp_path / "venv" / "left-by-the-same").exists()
    # another minor version in the same directory (python3.10 and python3.11 in /usr/bin), as
    # the venv's pyvenv.cfg of a 3.10 says: made afresh too
    cfg = tmp_path / "venv" / "pyvenv.cfg"
    cfg.write_text(re.sub(r"(?m)^version = .*$", "version = 3.10.13", cfg.read_text()))
    assert ensure_env(worker, EnvSpec(str(other), ("six==1.16.0",)), None).startswith(
        "installed; xtrain: warning: ")
    assert not (tmp_path / "venv" / "left-by-the-same").exists()


def test_a_missing_base_python_is_named_before_any_venv_is_made(remote, tmp_path):
    """A base Python the VM lacks. A bare ``python3.X`` would be installed from apt with
    passwordless sudo (TPU VMs; not tried here: this machine's packages are not the test's to
    change); a path is named as the setting to fix."""
    worker, runner, _ = make_worker(remote, tmp_path, venv=str(tmp_path / "venv"))
    with pytest.raises(LaunchError, match=r"/nonexistent/python3\.11 is not on this VM "
                                          r"\(hydra\.launcher\.base_python\)"):
        ensure_env(worker, EnvSpec("/nonexistent/python3.11", ("six==1.16.0",)), None)
    assert not (tmp_path / "venv").exists()


def test_env_managed_by_hand_is_verified_never_changed(remote, tmp_path):
    worker, runner, _ = make_worker(remote, tmp_path, venv=str(remote.root(HOSTS[0]) / "venv"))
    sync_xtrain(worker, runner)
    import omegaconf

    ok = EnvSpec("unused", (f"omegaconf=={omegaconf.__version__}",), install=False)
    assert ensure_env(worker, ok, None) == "verified"
    mismatch = r"omegaconf \S+ is installed, wanted ==0.0.1 \(hydra.launcher.install=false"
    with pytest.raises(LaunchError, match=mismatch):
        ensure_env(worker, EnvSpec("unused", ("omegaconf==0.0.1",), install=False), None)
    assert "install" not in runner.labels()


def test_ssh_reads_each_option_value_as_given():
    """Values with runs of spaces, quotes and a backslash, as ssh itself parses them (-G prints
    the options it would use; it connects to nothing)."""
    from xtrain.launcher.ssh import ssh_option

    for value in ("/tmp/a   b/k", "/tmp/o'b/kh", '/tmp/q"x/k', "/tmp/back\\slash/k", "/plain/k"):
        said = subprocess.run(["ssh", "-G", ssh_option("UserKnownHostsFile", value), "x"],
                              capture_output=True, text=True, stdin=subprocess.DEVNULL)
        assert f"userknownhostsfile {value}" in said.stdout.splitlines(), said.stderr


def test_a_remote_path_is_read_in_the_home_directory_unless_absolute(tmp_path):
    """A relative hydra.launcher.remote_dir is the home's, as for ssh and rsync: read in the dir
    a script had moved to, the venv's stamp was never found and every job's python was missing."""
    home = tmp_path / "a home"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    for path, expected in (("runs/x y", f"{home}/runs/x y"), ("~/runs", f"{home}/runs"),
                           ("~", str(home)), ("/opt/x y", "/opt/x y")):
        said = subprocess.run(["bash", "-c", f"p={worker_module._shell_path(path)}; echo \"$p\""],
                              cwd=elsewhere, env={**os.environ, "HOME": str(home)},
                              capture_output=True, text=True, check=True).stdout
        assert said == expected + "\n", path


def start(job, command, secrets=None, lockfile=None, grace=5):
    return job.start(command, "/", {"XTRAIN_WORKER": "0"}, secrets or {}, "a1", grace, lockfile)


def start_trapped(job, trap: str, marker: Path, then: str) -> int:
    """Start bash with ``trap`` and return once it is set: a stop before that would end bash by
    SIGTERM's default action, whatever the trap says (as happens on a loaded machine)."""
    pid = start(job, ["bash", "-c", f"{trap}; touch {marker}; {then}"])
    wait_for(marker.exists)
    return pid


def wait_for(predicate, timeout=30.0):
    deadline = time.time() + timeout
    while not predicate():
        assert time.time() < deadline, "timed out"
        time.sleep(0.1)


def test_a_job_runs_detached_and_its_end_is_recorded(remote, tmp_path):
    worker, _, _ = make_worker(remote, tmp_path)
    job = RemoteJob(worker, "unit")
    secret = "p@ss w'rd $HOME \"x\""
    digest = hashlib.sha256(secret.encode()).hexdigest()
    pid = start(job, [sys.executable, "-c", "import hashlib, os, signal as s, time; time.sleep(1); "
                      "print(hashlib.sha256(os.environ['XT_SECRET'].encode()).hexdigest()); "
                      "print('worker', os.environ['XTRAIN_WORKER']); "
                      "print('signals', s.getsignal(s.SIGINT) is s.default_int_handler, "
                      "s.getsignal(s.SIGQUIT) == s.getsignal(s.SIGTERM) == s.SIG_DFL); "
                      "raise SystemExit(3)"],
                secrets={"XT_SECRET": secret})
    assert job.state().state == "running"
    assert os.getpgid(pid) == pid  # a session of its own: an ssh session ending cannot reach it
    stream = job.follow(0)
    out = stream.stdout.read().decode()
    stream.wait()
    assert out.splitlines()[:2] == [digest, "worker 0"]  # the secret arrived intact, never printed
    assert out.splitlines()[2] == "signals True True"  # the default actions: Ctrl-C's, kill -INT's
    state = job.state()
    assert (state.state, state.exit_code, state.reported, state.attempt) == ("exited", 3, False, "a1")
    jobdir = Path(job.dir)
    assert not (jobdir / "secrets").exists()
    assert all(secret not in p.read_text() for p in jobdir.iterdir())
    job.acknowledge()
    assert job.state().reported


def test_stop_sends_sigterm_then_sigkill_after_the_grace(remote, tmp_path):
    worker, _, _ = make_worker(remote, tmp_path)
    job = RemoteJob(worker, "unit")
    start(job, ["sleep", "60"])
    assert job.stop(grace_s=5) is False  # sleep ends on SIGTERM
    assert (job.state().state, job.state().exit_code) == ("exited", 143)
    pid = start_trapped(job, "trap '' TERM", tmp_path / "trapped", "sleep 60")
    t0 = time.perf_counter()
    assert job.stop(grace_s=1.6) is True
    assert 1.6 <= time.perf_counter() - t0 < 10  # a fraction of a second counts too
    assert job.state().state == "lost"  # killed: no exit code
    assert live_group(pid) == []


def test_stopping_a_pods_others_names_the_killed_and_the_unreachable(remote, tmp_path):
    """After a worker failed the others are stopped: one that outlasts the grace is named as
    killed, one that does not answer (nothing listens on 127.0.0.4) or refuses the login is named
    too, its error not raised in place of the failure the launch reports."""
    from xtrain.launcher.job import stop_others

    worker, _, _ = make_worker(remote, tmp_path)
    job = RemoteJob(worker, "unit")
    start_trapped(job, "trap '' TERM", tmp_path / "trapped", "sleep 60")
    cfg = OmegaConf.structured(LauncherConfig(**remote.launcher_fields(
        hosts=["127.0.0.4"], retries=0, remote_dir=str(tmp_path / "hosts") + "/{host}")))
    gone = Worker(Target(1, "127.0.0.4", "127.0.0.4"), Ssh(cfg, Runner(), print), cfg.remote_dir,
                  cfg.venv)
    refused_cfg = OmegaConf.structured(LauncherConfig(**remote.launcher_fields(
        identity_file=str(keygen(tmp_path / "unknown_key")), retries=0,
        remote_dir=str(tmp_path / "hosts") + "/{host}")))
    refused = Worker(Target(2, HOSTS[0], HOSTS[0]), Ssh(refused_cfg, Runner(), print),
                     refused_cfg.remote_dir, refused_cfg.venv)
    said = []
    stop_others([job, RemoteJob(gone, "unit"), RemoteJob(refused, "unit")], 0.4, said.append)
    assert said[0] == f"launch: {worker} did not stop within 0.4 s of SIGTERM: killed"
    assert said[1].startswith(f"launch: {gone} could not be stopped (") and "unreachable" in said[1]
    assert said[2].startswith(f"launch: {refused} could not be stopped (") and \
        "login refused" in said[2], said[2]
    assert job.state().state == "lost"


def test_a_failed_start_is_reported_whatever_stopping_the_started_workers_says(remote, tmp_path):
    """A pod's start fails on one worker (its job dir cannot be made); the worker that started is
    stopped, but its network went after the start: it is named, and the launch reports the
    start's failure, not the cleanup's."""
    from types import SimpleNamespace

    from xtrain.launcher.launch import start_fresh

    cfg = OmegaConf.structured(LauncherConfig(**remote.launcher_fields(retries=0)))
    ssh = Ssh(cfg, Runner(), print)
    gone = Worker(Target(0, "127.0.0.4", "127.0.0.4"), ssh, cfg.remote_dir, cfg.venv)

    class LosesItsNetwork(RemoteJob):
        def start(self, *args):
            pid = super().start(*args)
            self.worker = gone  # (its dir stays: the stop looks for it on a host not answering)
            return pid

    workers = [Worker(Target(i, HOSTS[0], HOSTS[0]), ssh, str(tmp_path / f"w{i}"), cfg.venv)
               for i in range(2)]
    for w in workers:
        w.probe("unit")
    (tmp_path / "w1" / "jobs").rmdir()
    (tmp_path / "w1" / "jobs").write_text("a file where the job dirs go\n")
    said = []
    with pytest.raises(LaunchError, match=r"^worker 1 \(127\.0\.0\.2\): could not start the job"):
        start_fresh(cfg, SimpleNamespace(accelerator_type=None),
                    [LosesItsNetwork(workers[0], "unit"), RemoteJob(workers[1], "unit")], [],
                    "run", {}, said.append, {})
    assert said[-1].startswith("launch: worker 0 (127.0.0.4) could not be stopped ("), said


def test_a_failure_is_reported_when_a_worker_stopped_after_it_stops_answering(remote, tmp_path):
    """Worker 0's job fails, and worker 1's host goes with the job the launcher stops there (it
    stands in 127.0.0.4, where nothing listens, once its job is stopped). The launch then
    reported worker 1's host as unreachable, not worker 0's failure and the tail of its log;
    now it says the one and reports the other."""
    from xtrain.launcher.launch import follow

    cfg = OmegaConf.structured(LauncherConfig(**remote.launcher_fields(retries=0, backoff_s=0.1)))
    ssh, said = Ssh(cfg, Runner(), print), []
    gone = Worker(Target(1, "127.0.0.4", "127.0.0.4"), ssh, cfg.remote_dir, cfg.venv)

    class HostGoesWithTheJob(RemoteJob):
        def stop(self, grace_s):
            super().stop(grace_s)
            self.worker = gone
            return super().stop(grace_s)

    workers = [Worker(Target(i, HOSTS[0], HOSTS[0]), ssh, str(tmp_path / f"w{i}"), cfg.venv)
               for i in range(2)]
    for w in workers:
        w.probe("unit")
    jobs = [RemoteJob(workers[0], "unit"), HostGoesWithTheJob(workers[1], "unit")]
    start(jobs[0], ["bash", "-c", "sleep 1; echo its last words; exit 1"])
    start(jobs[1], ["sleep", "60"])
    (tmp_path / "job").mkdir()
    try:
        with pytest.raises(LaunchError, match=r"^worker 0 \(127\.0\.0\.2\) failed \(exit code 1\)"
                           ) as failure:
            follow(jobs, str(tmp_path / "job"), [0, 0], cfg, said.append)
    finally:
        RemoteJob(workers[1], "unit").stop(grace_s=1)
    assert "its last words" in str(failure.value)
    assert any(m.startswith("launch: 127.0.0.4") and "unreachable" in m for m in said), said


def test_a_job_that_exits_on_sigterm_keeps_its_own_exit_code(remote, tmp_path):
    """The stop's SIGTERM reaches the wrapper too: its exit code must stay the job's (3 here), not
    128 + 15, which reads as a preemption. Several rounds: the job and the wrapper race."""
    worker, _, _ = make_worker(remote, tmp_path)
    job = RemoteJob(worker, "unit")
    for attempt in range(4):
        start_trapped(job, "trap 'exit 3' TERM", tmp_path / f"trapped{attempt}", "sleep 60 & wait")
        job.stop(grace_s=5)
        assert (job.state().state, job.state().exit_code) == ("exited", 3)


def test_a_new_start_stops_what_an_earlier_run_of_the_job_left(remote, tmp_path):
    worker, _, _ = make_worker(remote, tmp_path)
    job = RemoteJob(worker, "unit")
    old = start(job, ["sleep", "60"])
    new = start(job, ["sleep", "60"])
    assert live_group(old) == []
    assert job.state().state == "running" and new != old
    job.stop(grace_s=5)
    assert len((Path(job.dir) / "starts").read_text().splitlines()) == 2


def test_a_job_whose_start_wrote_empty_files_has_a_state_with_neither_attempt_nor_command(
        tmp_path):
    """A start on a full disk leaves the job's attempt and command files empty: its state (read
    here by the same script, run locally) says it has neither, where a missing field had failed
    every later launch and stop of the job with a ValueError."""
    job = tmp_path / "job"
    job.mkdir()
    ended = subprocess.Popen(["true"])
    ended.wait()
    (job / "pid").write_text(f"{ended.pid}\n")
    for name in ("attempt", "command"):
        (job / name).write_text("")

    def state() -> JobState:
        r = subprocess.run(["bash", "-c", STATE_SH + f"job_state {shlex.quote(str(job))}"],
                           capture_output=True, text=True, check=True)
        return JobState.parse(r.stdout)

    assert state() == JobState("lost", None, False, None, 0, None)
    for name, value in (("attempt", "a2"), ("command", "c0ffee"), ("exit", "143")):
        (job / name).write_text(value + "\n")
    assert state() == JobState("exited", 143, False, "a2", 0, "c0ffee")


def test_a_pid_recorded_before_a_restart_is_neither_running_nor_signalled(remote, tmp_path):
    """After a VM restart the job dir's pid may be an unrelated live process group: the dir's boot
    id (the kernel's, at the start) tells them apart. Here the job itself plays that group, its
    boot id rewritten as if recorded before a restart."""
    worker, _, _ = make_worker(remote, tmp_path)
    job = RemoteJob(worker, "unit")
    unrelated = start(job, ["sleep", "60"])
    boot = Path(job.dir) / "boot"
    assert boot.read_text() == Path("/proc/sys/kernel/random/boot_id").read_text()
    boot.write_text("0c1d5a6e-0000-4000-8000-000000000000\n")
    try:
        assert job.state().state == "lost"  # ended by the restart, no exit code
        reattached = job.follow(0)  # the log to its end, not a wait on the unrelated group
        reattached.communicate(timeout=30)
        assert reattached.returncode == 0
        assert job.stop(grace_s=1) is False and live_group(unrelated) != []
        new = start(job, ["sleep", "60"])  # a new start cleans up only its own boot's job
        assert live_group(unrelated) != [] and job.state().state == "running"
        job.stop(grace_s=5)
        assert live_group(new) == []
    finally:
        os.killpg(unrelated, signal.SIGKILL)


def test_an_exited_jobs_pid_reused_by_another_group_is_neither_followed_nor_signalled(remote,
                                                                                      tmp_path):
    """The job exited (its exit code recorded), and its pid now leads another process group of
    the same user, started this boot (pids are reused; 32768 of them by default). The next
    start stopped that group, SIGKILL after the grace, and a follow waited for its end."""
    worker, _, _ = make_worker(remote, tmp_path)
    job = RemoteJob(worker, "unit")
    start(job, ["true"])
    wait_for(lambda: job.state().state == "exited")
    unrelated = subprocess.Popen(["setsid", "sleep", "60"])
    try:
        wait_for(lambda: live_group(unrelated.pid) != [])
        (Path(job.dir) / "pid").write_text(f"{unrelated.pid}\n")  # as if reused
        reattached = job.follow(0)
        reattached.communicate(timeout=30)
        assert reattached.returncode == 0
        assert job.stop(grace_s=0.4) is False
        new = start(job, ["sleep", "60"], grace=0.4)
        assert unrelated.poll() is None and job.state().state == "running"
        assert job.stop(grace_s=5) is False and live_group(new) == []
    finally:
        unrelated.kill()


def test_a_stop_still_ends_what_an_exited_jobs_group_left_running(remote, tmp_path):
    """The job's wrapper wrote its exit code, but a process the job started in its group lives
    on (here a background sleep): a stop or a new start still ends it."""
    worker, _, _ = make_worker(remote, tmp_path)
    job = RemoteJob(worker, "unit")
    pid = start(job, ["bash", "-c", "sleep 60 & exit 0"])
    wait_for(lambda: job.state().state == "exited")
    assert live_group(pid) != []
    job.stop(grace_s=5)
    assert live_group(pid) == []


# A job that cuts its own log stream (the remote end of it, a tail on the loopback host, which is
# this machine) once its last line reached the local copy (argv[1]), five times; then it stops
# the stream, prints its last words and exits 1, the stream killed a second later.
CUTTING_JOB = """
import os, signal, subprocess, sys, time
def tails():
    return [int(p) for p in os.listdir("/proc") if p.isdigit() and _follows(p)]
def _follows(pid):
    try:
        argv = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\\0")
    except OSError:
        return False
    return argv[0].endswith(b"tail") and any(a.endswith(b"/jobs/unit/log") for a in argv)
def arrived(text):
    deadline = time.time() + 60  # the launcher gave up: end, not wait for it forever
    while not (os.path.exists(sys.argv[1]) and text in open(sys.argv[1]).read() and tails()):
        if time.time() > deadline:
            sys.exit(2)
        time.sleep(0.05)
for i in range(5):
    print("tick", i, flush=True)
    arrived(f"tick {i}")
    for pid in tails():
        os.kill(pid, signal.SIGKILL)
print("tick 5", flush=True)
arrived("tick 5")
stopped = tails()
for pid in stopped:
    os.kill(pid, signal.SIGSTOP)
print("last words", flush=True)
subprocess.Popen(["bash", "-c", "sleep 1; kill -KILL " + " ".join(map(str, stopped))],
                 start_new_session=True)
sys.exit(1)
"""


def test_a_log_stream_cut_again_and_again_is_followed_to_the_jobs_last_line(remote, tmp_path):
    """Five cuts, each after the reconnect brought new lines, with retries=0 (three cuts in a
    row allowed): the launcher follows on. A cut just before the job's last line, the job ended
    when the launcher asks: that line is still fetched, into the local log and the failure."""
    from xtrain.launcher.launch import follow
    from xtrain.launcher.logs import log_path

    worker, _, messages = make_worker(remote, tmp_path, retries=0, backoff_s=0.1)
    job = RemoteJob(worker, "unit")
    job_dir = tmp_path / "job"
    job_dir.mkdir()
    start(job, [sys.executable, "-c", CUTTING_JOB, log_path(str(job_dir), 0)])
    try:
        with pytest.raises(LaunchError, match="exit code 1") as failure:
            follow([job], str(job_dir), [0], worker.ssh.cfg, messages.append)
    finally:
        job.stop(grace_s=1)  # (ended already, unless the follow gave up on it)
    assert "last words" in str(failure.value)
    assert Path(log_path(str(job_dir), 0)).read_text().splitlines() == [
        *(f"tick {i}" for i in range(6)), "last words"]
    assert sum("log stream cut" in m for m in messages) == 5


def test_a_stop_stops_the_job_where_workers_answer_and_names_the_others(remote, tmp_path,
                                                                        compose_config):
    """A pod's worker 1 does not answer (nothing listens on 127.0.0.4): hydra.launcher.stop=true
    still stops the job on worker 0 (the start's probe of every worker stopped it before), then
    fails naming worker 1. While a launch holds worker 0's launch lock (placing the job there),
    the stop waits for it."""
    from xtrain.launcher.launch import job_name, launch_job

    worker, _, _ = make_worker(remote, tmp_path, job=job_name("pod-stop"))
    job = RemoteJob(worker, job_name("pod-stop"))
    start(job, ["sleep", "60"])
    cfg = OmegaConf.structured(LauncherConfig(**remote.launcher_fields(
        hosts=[HOSTS[0], "127.0.0.4"], kind="pod", retries=0, stop=True, stop_grace_s=5,
        remote_dir=str(tmp_path / "hosts") + "/{host}")))
    pod = compose_config(["hardware=cpu", "hardware.hosts=2"]).hardware
    said = []
    with open(Path(worker.root) / "launch.lock", "a") as lock:  # a launch placing a job there
        fcntl.flock(lock, fcntl.LOCK_EX)
        outcome = []

        def stop():
            try:
                launch_job(cfg, pod, [], "pod-stop", str(tmp_path / "job"), log=said.append)
            except LaunchError as e:
                outcome.append(e)

        stopping = threading.Thread(target=stop, daemon=True)
        stopping.start()
        deadline = time.time() + 60
        while not any("is placing a job there: waiting for it" in str(m) for m in said):
            assert time.time() < deadline, said
            time.sleep(0.1)
        assert job.state().state == "running"  # the stop waits for the launch's start
    stopping.join(timeout=60)
    assert re.search(r"could not be stopped where the workers did not answer: worker 1 "
                     r"\(127\.0\.0\.4\): .*unreachable", str(outcome[0]))
    assert (job.state().state, job.state().exit_code) == ("exited", 143)


def test_the_launch_lock_makes_a_second_launch_wait_and_refuses_what_it_cannot_hold(remote,
                                                                                   tmp_path):
    """The worker's launch lock (xtrain/launcher/worker.py): a second launch waits for the first,
    naming where it runs; a lock whose connection ended is noticed before a start; two workers
    of one launch that share a remote dir are refused (each would wait for the other); a lock
    file that cannot be opened is the worker's refusal."""
    first, _, _ = make_worker(remote, tmp_path)
    second, _, _ = make_worker(remote, tmp_path)  # another launch, same worker
    said, order = [], []

    def second_launch():
        order.append("waiting")
        with launch_lock([second], said.append, 60):
            order.append("locked")

    with launch_lock([first], print, 60) as still_held:
        waiting = threading.Thread(target=second_launch)
        waiting.start()
        deadline = time.time() + 30
        while not said and time.time() < deadline:
            time.sleep(0.05)
        assert order == ["waiting"]  # held: the second launch waits
        assert re.fullmatch(rf"launch: worker 0 \({HOSTS[0]}\): another launch \({socket.gethostname()}"
                            r" since \d\d:\d\d:\d\d\) is placing a job there: waiting for it",
                            said[0]), said
        # one more, that waits 2 s at most; meanwhile the holder's line changes, as when the
        # holder it found lets go and another launch takes the lock: the refusal names that one
        third, _, _ = make_worker(remote, tmp_path)
        holder_line = Path(third.root) / "launch.holder"
        relay = threading.Timer(1.0, holder_line.write_text, ["beef relay-host since 12:34:56\n"])
        started = time.monotonic()
        relay.start()
        with pytest.raises(VmUnavailable, match=rf"worker 0 \({HOSTS[0]}\): another launch "
                                                r"\(relay-host since 12:34:56\) still "
                                                rf"held {third.root}/launch.lock after 2 s "
                                                r"\(hydra.launcher.lock_wait_s\)"):
            with launch_lock([third], print, 2):
                pass
        relay.join()
        assert time.monotonic() - started < 20
        assert order == ["waiting"]
        still_held()
    waiting.join(timeout=30)
    assert order == ["waiting", "locked"]  # released at the end of the first launch's block

    with launch_lock([first], print, 60) as still_held:
        for proc in ssh_processes(f"root={first.root}"):  # this test's lock alone
            os.kill(proc, signal.SIGKILL)  # the connection that holds it ends
        time.sleep(0.5)
        with pytest.raises(VmUnavailable, match="the launch lock's connection ended before the "
                                                "start, so nothing was started"):
            still_held()

    shared, _, _ = make_worker(remote, tmp_path, host=HOSTS[1], remote_dir=str(tmp_path / "one"))
    other, _, _ = make_worker(remote, tmp_path, host=HOSTS[0], remote_dir=str(tmp_path / "one"))
    other.index = 1
    with pytest.raises(ConfigError, match=rf"worker 1 \({HOSTS[0]}\) shares {tmp_path}/one with "
                                          "another worker of this launch"):
        with launch_lock([shared, other], print, 60):
            pass

    (tmp_path / "one" / "launch.lock").unlink()
    (tmp_path / "one" / "launch.lock").mkdir()  # cannot be opened as a file
    with pytest.raises(VmUnavailable, match=f"could not take {tmp_path}/one/launch.lock"):
        with launch_lock([shared], print, 60):
            pass


class LocalShell:
    """Runs hold_lock's command in a local shell that prints ``banner`` first, as a login script
    may (no newline after it), instead of over ssh: what hold_lock reads is the same."""

    def __init__(self, banner: str):
        self.banner = banner

    def hold(self, host, command, label):
        return subprocess.Popen(["bash", "-c", f"printf %s {shlex.quote(self.banner)}; {command}"],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL)


def test_the_launch_lock_reads_its_answer_past_a_banner_and_says_why_flock_failed(tmp_path):
    worker = Worker(Target(0, "127.0.0.2", "127.0.0.2"), LocalShell("Welcome to the VM"),
                    str(tmp_path), None)
    worker.root = str(tmp_path)
    proc = worker.hold_lock("t0k3n here since 12:00:00", print, 60)  # "Welcome...XTRAIN-LOCK locked"
    assert (tmp_path / "launch.holder").read_text() == "t0k3n here since 12:00:00\n"
    proc.stdin.close()
    proc.wait(timeout=10)
    (tmp_path / "launch.lock").unlink()
    (tmp_path / "launch.lock").mkdir()  # cannot be opened: the shell's own error is the reason
    with pytest.raises(VmUnavailable, match=r"could not take .*/launch.lock \(Welcome to the VM"
                                            r".*launch.lock: Is a directory\)"):
        worker.hold_lock("t0k3n here since 12:00:00", print, 60)


def test_a_stop_given_while_a_launch_takes_a_pods_locks_stops_every_worker(remote, tmp_path,
                                                                           compose_config):
    """A launch holds worker 0's lock and is about to take worker 1's: the stop waits for worker
    0's lock before it looks at any worker, so it cannot find worker 1 idle just before the
    launch starts the job there; once the locks are free it stops the job on both. The stop is
    given from a directory that is no git checkout: it syncs nothing, so no checkout's state can
    keep it from stopping a job."""
    from xtrain.launcher.launch import job_name, launch_job

    jobs = []
    for host in HOSTS[:2]:
        worker, _, _ = make_worker(remote, tmp_path, host=host, job=job_name("pod-race"))
        jobs.append(RemoteJob(worker, job_name("pod-race")))
        start(jobs[-1], ["sleep", "60"])
    cfg = OmegaConf.structured(LauncherConfig(**remote.launcher_fields(
        hosts=list(HOSTS[:2]), kind="pod", stop=True, stop_grace_s=5, source=str(tmp_path),
        remote_dir=str(tmp_path / "hosts") + "/{host}")))
    pod = compose_config(["hardware=cpu", "hardware.hosts=2"]).hardware
    said = []
    with open(Path(jobs[0].worker.root) / "launch.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        stopping = threading.Thread(target=launch_job, daemon=True, kwargs=dict(
            cfg=cfg, hardware=pod, overrides=[], run_name="pod-race", job_dir=str(tmp_path / "job"),
            log=said.append))
        stopping.start()
        deadline = time.time() + 60
        while not any("is placing a job there: waiting for it" in str(m) for m in said):
            assert time.time() < deadline, said
            time.sleep(0.1)
        time.sleep(1)
        assert [j.state().state for j in jobs] == ["running", "running"]  # neither touched yet
    stopping.join(timeout=60)
    assert [(j.state().state, j.state().exit_code) for j in jobs] == 2 * [("exited", 143)]
    assert "launch: stopped job pod-race on 2 worker(s)" in said


def test_a_stale_tpu_lock_is_removed_and_a_held_one_refused(remote, tmp_path):
    worker, _, _ = make_worker(remote, tmp_path)
    job = RemoteJob(worker, "unit")
    lock = tmp_path / "libtpu_lockfile"
    lock.write_text("")
    start(job, ["true"], lockfile=str(lock))
    assert not lock.exists()
    lock.write_text("")
    holder = subprocess.Popen([sys.executable, "-c", f"f = open({str(lock)!r}); import time; "
                               "time.sleep(60)"])
    try:
        wait_for(lambda: any(os.path.realpath(f"/proc/{holder.pid}/fd/{fd}") == str(lock)
                             for fd in os.listdir(f"/proc/{holder.pid}/fd")))
        with pytest.raises(LaunchError, match=f"the TPU is in use: process {holder.pid} holds"):
            start(job, ["true"], lockfile=str(lock))
        assert lock.exists()
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
