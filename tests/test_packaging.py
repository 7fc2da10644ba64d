"""`pip install .` ships the package and its configs; `make test` finds (or installs) the system
packages the tests use."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_wheel_contains_every_config_and_module(tmp_path):
    # built from a copy: setuptools writes build/ and xtrain.egg-info/ beside the sources
    source = tmp_path / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source)
    for name in ("conf", "launch", "xtrain"):
        shutil.copytree(ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                        "-q", "-w", str(tmp_path), str(source)], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    # setuptools warns (a 40-line banner each, shown by `make setup`) for a folder of the sources
    # that pyproject.toml does not list as a package
    assert "BuildBackendWarning" not in r.stderr, r.stderr
    (wheel,) = tmp_path.glob("xtrain-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for yaml in (ROOT / "conf").rglob("*.yaml"):
        assert f"xtrain/conf/{yaml.relative_to(ROOT / 'conf')}" in names
    for module in (ROOT / "xtrain").rglob("*.py"):
        assert str(module.relative_to(ROOT)) in names, module
    for plugin in (ROOT / "launch" / "hydra_plugins").rglob("*.py"):  # launchers, the sweeper
        assert str(plugin.relative_to(ROOT / "launch")) in names, plugin
    assert "xtrain/evals/cpp_problems.jsonl" in names  # the C++ benchmark
    assert not any(n.startswith("hydra_plugins/__init__") for n in names)  # a namespace package


def test_missing_system_tools_are_named_where_apt_cannot_install_them(tmp_path):
    # an empty PATH: rsync, bwrap and apt-get are not found (sshd may be, at /usr/sbin/sshd)
    r = subprocess.run(["/bin/bash", str(ROOT / ".ci" / "system-tools")], capture_output=True,
                       text=True, env={"PATH": str(tmp_path)}, timeout=30)
    assert r.returncode == 1, r.stderr
    assert "apt-get is not here" in r.stderr and "rsync" in r.stderr and "bubblewrap" in r.stderr
    assert "installing" not in r.stderr


def test_present_system_tools_install_nothing():
    r = subprocess.run(["/bin/bash", str(ROOT / ".ci" / "system-tools")], capture_output=True,
                       text=True, timeout=30)
    assert r.returncode == 0 and r.stdout == r.stderr == "", r.stderr
