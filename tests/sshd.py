"""Test fixtures for the launchers: a real OpenSSH server on loopback standing in for TPU VM
workers, and a stand-in ``gcloud`` (the one thing that cannot exist here).

``Sshd`` runs ``/usr/sbin/sshd -D`` with its own config, a throwaway host key and a throwaway user
key in its ``AuthorizedKeysFile``, listening on 127.0.0.2 and 127.0.0.3 (every 127.0.0.0/8 address
is this machine), so the two addresses act as two hosts; each test host gets its own remote
directory through the launcher's ``remote_dir=.../{host}``. Also used by tests/bench/launch.py.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

HOSTS = ("127.0.0.2", "127.0.0.3")
ROOT = Path(__file__).resolve().parent.parent
MAIN_PYTHON = Path(sys.executable)
BASE_PYTHON = Path(getattr(sys, "_base_executable", sys.executable))  # the interpreter behind the venv


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOSTS[0], 0))
        return s.getsockname()[1]


def keygen(path: Path) -> Path:
    for old in (path, Path(f"{path}.pub")):
        old.unlink(missing_ok=True)
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "xtrain-test", "-f",
                    str(path)], check=True, stdin=subprocess.DEVNULL)
    return path


class Sshd:
    def __init__(self, workdir: Path):
        self.dir = workdir
        self.dir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.host_key = keygen(self.dir / "host_key")
        self.user_key = keygen(self.dir / "user_key")
        shutil.copy(str(self.user_key) + ".pub", self.dir / "authorized_keys")
        self.known_hosts = self.dir / "known_hosts"
        self.proc = None

    def config(self) -> str:
        return textwrap.dedent(f"""\
            Port {self.port}
            ListenAddress {HOSTS[0]}
            ListenAddress {HOSTS[1]}
            HostKey {self.host_key}
            AuthorizedKeysFile {self.dir}/authorized_keys
            PidFile {self.dir}/sshd.pid
            UsePAM no
            PermitRootLogin prohibit-password
            PasswordAuthentication no
            KbdInteractiveAuthentication no
            # the key files live under /tmp, which StrictModes would reject as world-writable
            StrictModes no
            """)

    def start(self) -> "Sshd":
        sshd = shutil.which("sshd") or "/usr/sbin/sshd"
        if not os.path.exists(sshd):
            pytest.fail("sshd not found: `make test` installs it (.ci/system-tools)")
        os.makedirs("/run/sshd", exist_ok=True)  # sshd's privilege-separation directory
        (self.dir / "sshd_config").write_text(self.config())
        self.log = open(self.dir / "sshd.log", "w")
        self.proc = subprocess.Popen([sshd, "-D", "-e", "-f", str(self.dir / "sshd_config")],
                                     stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.time() + 20
        while not all(self._listening(h) for h in HOSTS):
            if self.proc.poll() is not None or time.time() > deadline:
                raise RuntimeError("sshd did not start: " + (self.dir / "sshd.log").read_text())
            time.sleep(0.05)
        return self

    def _listening(self, host: str) -> bool:
        try:
            socket.create_connection((host, self.port), timeout=0.5).close()
            return True
        except OSError:
            return False

    def stop(self) -> None:
        """Stop sshd and the per-connection sshd processes it forked (ssh ControlMaster
        connections would keep those alive); only processes this fixture started."""
        if self.proc is None:
            return
        children = [pid for pid in _children(self.proc.pid)]
        self.proc.terminate()
        self.proc.wait(10)
        for pid in children:
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        self.log.close()


def _proc(name: str):
    """(pid, bytes) of ``/proc/<pid>/<name>`` for every process that still has it."""
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                yield int(entry.name), (entry / name).read_bytes()
            except OSError:
                continue


def _stat_fields(stat: bytes) -> list[str]:
    """A /proc stat line's fields after the command name: state, ppid, pgrp, ..."""
    return stat.decode(errors="replace").rsplit(")", 1)[1].split()


def live_group(pgid: int) -> list[int]:
    """Live (not zombie) processes of a process group, read from /proc. Zombies count as
    gone: this machine's PID 1 does not reap orphans, so `kill -0` would see them forever."""
    return [pid for pid, stat in _proc("stat")
            if int(_stat_fields(stat)[2]) == pgid and _stat_fields(stat)[0] != "Z"]


def _children(pid: int) -> list[int]:
    return [child for child, stat in _proc("stat") if int(_stat_fields(stat)[1]) == pid]


def ssh_processes(marker: str) -> list[int]:
    """Local ssh clients whose command line contains ``marker``."""
    return [pid for pid, cmdline in _proc("cmdline") if (argv := cmdline.split(b"\0"))[0] == b"ssh"
            and any(marker.encode() in a for a in argv)]


def stack_venv(path: Path) -> Path:
    """A venv whose site-packages reach this machine's full stack (torch, lightning, hydra...)
    through a .pth file, so a launch's pip finds every requirement satisfied without downloading
    7 GB, and nothing is ever installed into /work/main/.venv."""
    if not (path / "bin" / "python").exists():
        subprocess.run([str(BASE_PYTHON), "-m", "venv", str(path)], check=True)
        site = subprocess.run([str(MAIN_PYTHON), "-c", "import site; print(site.getsitepackages()[0])"],
                              check=True, capture_output=True, text=True).stdout.strip()
        own = subprocess.run([str(path / "bin" / "python"), "-c",
                              "import site; print(site.getsitepackages()[0])"],
                             check=True, capture_output=True, text=True).stdout.strip()
        Path(own, "xtrain-test-stack.pth").write_text(site + "\n")
    return path


# The stand-in gcloud (tests/gcloud_standin.py: it records every call and replays TPU VM and
# queued-resource JSON in gcloud's format, states and create outcomes from a scenario).
GCLOUD = '''#!/bin/sh
exec {python} {script} "$@"
'''


# acceleratorType -> the node's acceleratorConfig (TPU API v2 AcceleratorConfig: type, topology)
ACCELERATOR_CONFIGS = {"v6e-1": ("V6E", "1x1"), "v6e-4": ("V6E", "2x2"), "v6e-8": ("V6E", "2x4"),
                       "v5litepod-8": ("V5LITE_POD", "2x4"), "v4-8": ("V4", "2x2x1"),
                       "v4-32": ("V4", "2x2x4")}


def tpu_node(name: str, zone: str, accelerator: str, endpoints, state: str = "READY") -> dict:
    """A TPU VM as gcloud describes it; ``endpoints``: (internal, external) address per worker."""
    kind, topology = ACCELERATOR_CONFIGS[accelerator]
    return {
        "acceleratorConfig": {"topology": topology, "type": kind},
        "acceleratorType": accelerator,
        "apiVersion": "V2",
        "cidrBlock": "10.146.0.0/20",
        "createTime": "2026-11-20T08:12:31.845Z",
        "health": "HEALTHY",
        "id": "4406231791221346843",
        "metadata": {"ssh-keys": "dave:ssh-rsa AAAA... dave"},
        "name": f"projects/xtrain-test/locations/{zone}/nodes/{name}",
        "networkConfig": {"enableExternalIps": True,
                          "network": "projects/xtrain-test/global/networks/default",
                          "subnetwork": "projects/xtrain-test/regions/asia-northeast1/subnetworks/"
                                        "default"},
        "networkEndpoints": [{"accessConfig": {"externalIp": ext}, "ipAddress": internal, "port": 8470}
                             for internal, ext in endpoints],
        "runtimeVersion": "v2-alpha-tpuv6e",
        "schedulingConfig": {"spot": True},
        "serviceAccount": {"email": "123-compute@developer.gserviceaccount.com",
                           "scope": ["https://www.googleapis.com/auth/cloud-platform"]},
        "shieldedInstanceConfig": {},
        "state": state,
    }


class FakeGcloud:
    def __init__(self, workdir: Path):
        self.dir = workdir
        (self.dir / "nodes").mkdir(parents=True, exist_ok=True)
        (self.dir / "bin").mkdir(exist_ok=True)
        exe = self.dir / "bin" / "gcloud"
        exe.write_text(GCLOUD.format(python=sys.executable,
                                     script=Path(__file__).with_name("gcloud_standin.py")))
        exe.chmod(0o755)

    def add(self, node: dict, queued: bool = False) -> None:
        name = node["name"].rsplit("/", 1)[-1]
        folder = self.dir / ("queued" if queued else "nodes")
        folder.mkdir(exist_ok=True)
        (folder / f"{name}.json").write_text(json.dumps(node, indent=1))

    def set_state(self, name: str, state: str, queued: bool = False) -> None:
        """What the VM is now (e.g. PREEMPTED): every later describe reports it."""
        path = self.dir / ("queued" if queued else "nodes") / f"{name}.json"
        node = json.loads(path.read_text())
        node["state"] = {"state": state} if queued else state
        node.pop("x-states", None)
        path.write_text(json.dumps(node, indent=1))

    def scenario(self, name: str, **what) -> None:
        """What happens to ``name`` next (creates, states, endpoints, wipe, host_key): the fields
        are described in tests/gcloud_standin.py."""
        (self.dir / "scenarios").mkdir(exist_ok=True)
        (self.dir / "scenarios" / f"{name}.json").write_text(json.dumps(what, indent=1))

    def calls(self) -> list[list[str]]:
        path = self.dir / "calls.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    def env(self) -> dict:
        """Environment putting the stand-in first on PATH (a real gcloud may be installed)."""
        return {"PATH": f"{self.dir / 'bin'}{os.pathsep}{os.environ['PATH']}",
                "XTRAIN_FAKE_GCLOUD": str(self.dir)}


def git_tree(path: Path) -> Path:
    """A small git checkout: tracked, untracked, ignored, secret-looking and data files."""
    subprocess.run(["git", "init", "-q", str(path)], check=True)
    for rel, text in {"pkg/mod.py": "x = 1\n", ".gitignore": "ignored/\n*.log\n",
                      "ignored/big.txt": "no\n", "run.log": "no\n", "new_untracked.py": "y\n",
                      ".env": "WANDB_API_KEY=no\n", "keys/id_ed25519": "no\n", ".envrc": "no\n",
                      ".git-credentials": "no\n", ".boto": "no\n", "gcp-key.json": "{}\n",
                      "gcloud/application_default_credentials.json": "{}\n",
                      "data/shard.parquet": "no\n", "outputs/x/metrics.jsonl": "{}\n"}.items():
        (path / rel).parent.mkdir(parents=True, exist_ok=True)
        (path / rel).write_text(text)
    subprocess.run(["git", "-C", str(path), "add", "pkg/mod.py", ".gitignore"], check=True)
    return path


class Remote:
    """What the tests need to know about the fake workers."""

    def __init__(self, base: Path, sshd: Sshd, cache: str):
        self.base, self.sshd, self.cache = base, sshd, cache

    def root(self, host: str) -> Path:
        return self.base / "hosts" / host

    def launcher_fields(self, hosts=(HOSTS[0],), **extra) -> dict:
        fields = {"hosts": list(hosts), "port": self.sshd.port, "user": "root",
                  "identity_file": str(self.sshd.user_key), "known_hosts": str(self.sshd.known_hosts),
                  "remote_dir": str(self.base / "hosts") + "/{host}", "base_python": str(BASE_PYTHON),
                  "retries": 1, "backoff_s": 0.2, "connect_timeout_s": 5, "stop_grace_s": 10,
                  "env": {"XTRAIN_CACHE": self.cache}}
        fields.update(extra)
        return fields

    def overrides(self, launcher: str = "tpu_vm", **fields) -> list[str]:
        """The same fields as `hydra.launcher.*` command-line overrides."""
        out = [f"hydra/launcher={launcher}"]
        for key, value in self.launcher_fields(**fields).items():
            if isinstance(value, dict):
                out += [f"+hydra.launcher.{key}.{k}={_hydra_value(v)}" for k, v in value.items()]
            elif isinstance(value, list):
                out.append(f"hydra.launcher.{key}=[{','.join(_hydra_value(v) for v in value)}]")
            else:
                out.append(f"hydra.launcher.{key}={_hydra_value(value)}")
        return out


def _hydra_value(value) -> str:
    if isinstance(value, str):
        return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"
    return str(value).lower() if isinstance(value, bool) else str(value)


# pytest fixtures (import them into a test module: `from tests.sshd import remote, sshd, gcloud`)

@pytest.fixture(scope="session")
def sshd(tmp_path_factory):
    server = Sshd(tmp_path_factory.mktemp("sshd")).start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def remote(sshd, tmp_path_factory, xtrain_cache):
    """The two fake workers, each with a stack venv; the directory is per session (shared by
    the test modules), the remote jobs share the session's corpus cache."""
    base = tmp_path_factory.getbasetemp() / "launch-remote"
    for host in HOSTS:
        stack_venv(base / "hosts" / host / "venv")
    return Remote(base, sshd, xtrain_cache)


@pytest.fixture
def gcloud(tmp_path, monkeypatch):
    fake = FakeGcloud(tmp_path / "gcloud")
    for key, value in fake.env().items():
        monkeypatch.setenv(key, value)
    return fake
