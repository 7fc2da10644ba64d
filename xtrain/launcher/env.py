"""A worker's Python environment: a venv holding the hardware profile's pins and xtrain's
dependencies (``[project].dependencies`` of the synced pyproject.toml).

xtrain itself is not installed there: jobs run the synced code from its own directory
(``cd code && python -m xtrain``), so a code change never reinstalls anything. The install is
idempotent: a stamp (a hash of the base Python, the requirements and the pip arguments) is kept
in the venv and read by the worker probe, so an unchanged environment costs no extra call; when
it differs, pip installs, the versions are verified, and only then is the stamp written.
With ``install=false`` the environment (managed by hand) is only verified, never changed.
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
        blob = json.dumps([self.base_python, sorted(self.requirements), list(self.pip_args)])
        return hashlib.sha256(blob.encode()).hexdigest()[:20]


def ensure_env(worker, spec: EnvSpec, found_stamp: str | None) -> str:
    """Make ``worker.venv`` satisfy ``spec``; returns what was done: unchanged, installed, verified."""
    if spec.install and found_stamp == spec.stamp:
        return "unchanged"
    venv, q = worker.venv, shlex.quote
    if spec.install:
        pip = " ".join(q(a) for a in ["-m", "pip", "install", "--disable-pip-version-check",
                                      "--no-input", "--quiet", *spec.pip_args, *spec.requirements])
        # none yet, or a venv whose creation stopped short (no pip: ensurepip missing on the
        # VM) is made again, keeping what it holds; a directory that is not a venv is left to
        # fail in pip
        script = (f"set -e\nv={q(venv)}\n"
                  'if ! "$v/bin/python" -m pip --version >/dev/null 2>&1 && '
                  '{ [ ! -e "$v/bin/python" ] || [ -f "$v/pyvenv.cfg" ]; }; then\n'
                  f'  {q(spec.base_python)} -m venv "$v"\nfi\n'
                  f'"$v/bin/python" {pip}\n')
        r = worker.run(script, "install", timeout=None)
        if not r.ok:
            raise LaunchError(f"worker {worker.index} ({worker.host}): installing into {venv} "
                              f"failed:\n{_tail(r.stderr or r.stdout)}")
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
    return "installed"


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
