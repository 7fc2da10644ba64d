"""A worker's Python environment: a venv holding the hardware profile's pins and xtrain's
dependencies (``[project].dependencies`` of the synced pyproject.toml).

xtrain itself is not installed there: jobs run the synced code from its own directory
(``cd code && python -m xtrain``), so a code change never reinstalls anything. The install is
idempotent: a stamp (a hash of the base Python, the requirements and the pip arguments) is kept
in the venv and read by the worker probe, so an unchanged environment costs no extra call; when
it differs, pip installs, the versions are verified, and only then is the stamp written.
With ``install=false`` the environment (managed by hand) is only verified, never changed.
The install also brings the system tools jobs use (:data:`SYSTEM_TOOLS`) from apt, where
passwordless sudo allows (as on TPU VMs); where not, it says so and goes on.
"""

from __future__ import annotations

import hashlib
import json
import re
import shlex
import tomllib
from dataclasses import dataclass
from pathlib import Path

from xtrain.launcher.runner import LaunchError

STAMP = ".xtrain-stamp"
INSTALL_LOCK_WAIT_S = 1800  # how long a launch waits for another install (pip's takes minutes)
# Tools the jobs use from the system, and their Debian package: bubblewrap is the C++
# evaluation's sandbox (xtrain/evals/sandbox.py), which refuses to run without it unless root.
SYSTEM_TOOLS = {"bwrap": "bubblewrap"}
APT_GET = "apt-get"  # the package manager the install script calls
# Exits 0 when this Python made the venv whose pyvenv.cfg is argv[1]: the ``home`` it records
# (the venv module's own rule, the same in Python 3.10 to 3.13) and its version's major.minor
# (python3.10 and python3.11 may share /usr/bin; a patch release keeps the venv's packages)
SAME_PYTHON_PY = (
    "import os, sys\n"
    "cfg = dict(l.split(' = ', 1) for l in open(sys.argv[1]).read().splitlines() if ' = ' in l)\n"
    "home = os.path.dirname(os.path.abspath(sys._base_executable))\n"
    "minor = '%d.%d' % sys.version_info[:2]\n"
    "sys.exit(cfg.get('home') != home or cfg.get('version', '').rsplit('.', 1)[0] != minor)\n")


def requirements(root: Path, pins: dict) -> list[str]:
    """xtrain's dependencies with the profile's pins replacing same-named entries."""
    with open(root / "pyproject.toml", "rb") as f:
        deps = tomllib.load(f)["project"]["dependencies"]
    pinned = {_normalize(name): f"{name}=={version}" for name, version in pins.items()}
    return [d for d in deps if _normalize(_name(d)) not in pinned] + sorted(pinned.values())


def _name(requirement: str) -> str:
    return re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", requirement.strip()).group(0)


def _normalize(name: str) -> str:  # PEP 503
    return re.sub(r"[-_.]+", "-", name).lower()


@dataclass(frozen=True)
class EnvSpec:
    base_python: str  # creates the venv, e.g. python3.11
    requirements: tuple[str, ...]
    pip_args: tuple[str, ...] = ()
    install: bool = True

    @property
    def stamp(self) -> str:
        blob = json.dumps([self.base_python, sorted(self.requirements), list(self.pip_args),
                           sorted(SYSTEM_TOOLS.items())])
        return hashlib.sha256(blob.encode()).hexdigest()[:20]


def ensure_env(worker, spec: EnvSpec, found_stamp: str | None, lacks=()) -> str:
    """Make ``worker.venv`` satisfy ``spec``; returns what was done (unchanged, installed,
    verified), with the install's warnings. ``lacks``: the :data:`SYSTEM_TOOLS` the worker's probe
    did not find, tried again (apt alone) where the venv is unchanged."""
    if spec.install and found_stamp == spec.stamp:
        if not lacks:
            return "unchanged"
        r = worker.run(f"set -e\n{system_tools_script()}", "system tools", timeout=None)
        if not r.ok:
            raise LaunchError(f"worker {worker.index} ({worker.host}): installing "
                              f"{', '.join(lacks)} failed:\n{_tail(r.stderr or r.stdout)}")
        return "; ".join(["unchanged", *_warnings(r)])
    venv, q = worker.venv, shlex.quote
    if spec.install:
        pip = " ".join(q(a) for a in ["-m", "pip", "install", "--disable-pip-version-check",
                                      "--no-input", "--quiet", *spec.pip_args, *spec.requirements])
        # none yet, or a venv whose creation stopped short (no pip: ensurepip missing on the
        # VM) is made again, keeping what it holds; one another Python made (base_python or
        # hardware.python changed: its packages are built for that one) is made afresh; a
        # directory that is not a venv is left to fail in pip
        base = q(spec.base_python)
        remade = q(f"xtrain: warning: {venv} was made by another Python: made afresh with "
                   f"{spec.base_python}")
        # one install from the worker's root at a time: one a killed launch left running (sshd
        # does not signal a session without a terminal) ends before another starts, or after
        # INSTALL_LOCK_WAIT_S the launch says so
        lock, busy = f"{worker.root}/install.lock", q(
            f"another install from {worker.root} has run for {INSTALL_LOCK_WAIT_S} s (one a "
            "killed launch left running?): stop it, or wait and launch again")
        script = (f"set -e\nv={q(venv)}\n"
                  f"exec 8>>{q(lock)}\n"
                  f"flock -w {INSTALL_LOCK_WAIT_S} 8 || {{ echo {busy} >&2; exit 1; }}\n"
                  f"{base_python_script(spec.base_python)}"
                  f'if [ -f "$v/pyvenv.cfg" ] && ! {base} -c {q(SAME_PYTHON_PY)} "$v/pyvenv.cfg"; '
                  "then\n"
                  f"  echo {remade} >&2\n"
                  f'  {base} -m venv --clear "$v"\n'
                  'elif ! "$v/bin/python" -m pip --version >/dev/null 2>&1 && '
                  '{ [ ! -e "$v/bin/python" ] || [ -f "$v/pyvenv.cfg" ]; }; then\n'
                  f'  {base} -m venv "$v"\nfi\n'
                  f"{system_tools_script()}"
                  f'"$v/bin/python" {pip}\n')
        r = worker.run(script, "install", timeout=None)
        if not r.ok:
            raise LaunchError(f"worker {worker.index} ({worker.host}): installing into {venv} "
                              f"failed:\n{_tail(r.stderr or r.stdout)}")
        warnings = _warnings(r)
    problems = verify(worker, spec.requirements)
    if problems:
        hint = "" if spec.install else " (hydra.launcher.install=false: fix it by hand, or let " \
                                          "xtrain install)"
        raise LaunchError(f"worker {worker.index} ({worker.host}): {venv} does not match the "
                          "profile: " + "; ".join(problems) + hint)
    if not spec.install:
        return "verified"
    listing = "\n".join(spec.requirements)
    worker.run(f"printf '%s\\n' {q(listing)} > {q(venv)}/xtrain-requirements.txt\n"
               f"echo {spec.stamp} > {q(venv)}/{STAMP}\n", "stamp")
    return "; ".join(["installed", *warnings])  # a tool still missing: tried at the next launch


def _warnings(result) -> list[str]:
    return [line for line in result.stderr.splitlines() if line.startswith("xtrain: warning:")]


def base_python_script(base_python: str) -> str:
    """Shell lines that make sure ``base_python`` exists on the worker. A TPU VM's image has
    the distribution's Python only (Ubuntu 22.04: 3.10), and a VM the fleet recreates is a fresh
    image: a missing ``pythonX.Y`` is installed with its venv module from apt, where passwordless
    sudo allows (as on TPU VMs); anything else missing is an error naming the fix."""
    missing = f"{base_python} is not on this VM"
    if re.fullmatch(r"python3\.\d+", base_python) is None:
        install = [f"echo {shlex.quote(missing + ' (hydra.launcher.base_python)')} >&2", "exit 1"]
    else:
        packages = f"{base_python} {base_python}-venv"
        refusal = (f"{missing}, and no apt-get with passwordless sudo installs it: "
                   f"apt-get install {packages}")
        install = _apt_install(missing, packages, [f"echo {shlex.quote(refusal)} >&2", "exit 1"])
    return _indent(_if_missing(base_python, install))


def system_tools_script() -> str:
    """Shell lines that install :data:`SYSTEM_TOOLS` missing on the worker, where apt and
    passwordless sudo allow; otherwise, or when the package brought no such tool, a warning (the
    job that needs one says so at its start)."""
    lines = []
    for tool, package in SYSTEM_TOOLS.items():
        missing = f"{tool} is not on this VM"
        warning = (f"xtrain: warning: {missing}, and no apt-get with passwordless sudo installs "
                   f"it: apt-get install {package}")
        failed = f"xtrain: warning: installing {package} failed"
        absent = f"xtrain: warning: {tool} is still not on this VM after installing {package}"
        lines += _if_missing(tool, _apt_install(
            missing, package, [f"echo {shlex.quote(warning)} >&2"],
            or_else=f"echo {shlex.quote(failed)} >&2",
            then=_if_missing(tool, [f"echo {shlex.quote(absent)} >&2"])))
    return _indent(lines)


def _if_missing(command: str, lines: list[str]) -> list[str]:
    return [f"if ! command -v {shlex.quote(command)} >/dev/null 2>&1; then",
            *["  " + line for line in lines], "fi"]


def _apt_install(missing: str, packages: str, without_apt: list[str], or_else: str = "",
                 then: list[str] = ()) -> list[str]:
    """Install ``packages`` from apt with passwordless sudo (as on TPU VMs), else ``without_apt``;
    ``or_else`` runs when apt fails (by default the script's ``set -e`` stops it), ``then`` when
    it succeeds."""
    apt = f"sudo -n env DEBIAN_FRONTEND=noninteractive {APT_GET} -o DPkg::Lock::Timeout=600 -q -y"
    update, install = f"{apt} update >&2", f"{apt} install {packages} >&2"
    steps = [update, install, *then] if not or_else else [
        f"if {update} && {install}; then", *["  " + line for line in then or [":"]],
        "else", f"  {or_else}", "fi"]
    return [f"if command -v {APT_GET} >/dev/null 2>&1 && sudo -n true 2>/dev/null; then",
            f"  echo {shlex.quote(f'xtrain: {missing}: installing {packages} from apt')} >&2",
            *["  " + step for step in steps],
            "else",
            *["  " + line for line in without_apt],
            "fi"]


def _indent(lines: list[str]) -> str:
    return "".join(f"  {line}\n" for line in lines)


def verify(worker, reqs) -> list[str]:
    """Ask the venv's Python, on the worker, which requirements it does not satisfy."""
    q = shlex.quote
    r = worker.run(f"cd {q(worker.code)} && {worker.python_env()} {q(worker.venv)}/bin/python -m "
                   f"xtrain.launcher.envcheck {' '.join(q(x) for x in reqs)}\n", "verify")
    if not r.ok:
        raise LaunchError(f"worker {worker.index} ({worker.host}): cannot run {worker.venv}/bin/python:"
                          f"\n{_tail(r.stderr)}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def _tail(text: str, lines: int = 15) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])
