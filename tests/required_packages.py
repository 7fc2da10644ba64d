"""In CI (``CI=true``), ``pytest.importorskip`` of a package pyproject.toml declares fails the test
instead of skipping it: a dependency that failed to install (torch_xla, jax, libtpu, flax, the
GCS emulator) must not turn the tests that need it into a green run with skips.

The declared packages are read from pyproject.toml (dependencies and every extra, with their
environment markers evaluated here), so they are listed once. A missing module counts when the
module pytest could not import, or the module *it* failed to import (torch_xla's torchax needs
flax), belongs to a declared distribution. Outside CI, skipping stays as pytest does it.
"""

from __future__ import annotations

import functools
import importlib
import os
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"
# Import names where they differ from the distribution's name (torch_xla's wheel ships torchax).
IMPORT_NAMES = {"hydra-core": ("hydra",), "torch-xla": ("torch_xla", "torchax")}


def declared_requirements(pyproject: Path = PYPROJECT) -> list[Requirement]:
    """pyproject.toml's dependencies and every extra, those whose marker holds on this machine."""
    project = tomllib.loads(pyproject.read_text())["project"]
    lines = list(project["dependencies"])
    for extra in project.get("optional-dependencies", {}).values():
        lines += extra
    return [req for req in map(Requirement, lines) if req.marker is None or req.marker.evaluate()]


def declared_imports(pyproject: Path = PYPROJECT) -> dict[str, str]:
    """Top-level import name -> the pyproject requirement providing it, for every requirement
    whose marker holds on this machine."""
    out = {}
    for req in declared_requirements(pyproject):
        name = canonicalize_name(req.name)
        for module in IMPORT_NAMES.get(name, (name.replace("-", "_"),)):
            out[module] = str(req)
    return out


def strict_importorskip(original, declared: dict[str, str]):
    """``pytest.importorskip`` that fails, rather than skips, on a declared package."""

    @functools.wraps(original)
    def importorskip(modname, *args, **kwargs):
        __tracebackhide__ = True
        problem = None
        try:
            importlib.import_module(modname)
        except ModuleNotFoundError as e:
            missing = (e.name or modname).split(".")[0]
            owner = next((m for m in (missing, modname.split(".")[0]) if m in declared), None)
            if owner:
                problem = (f"CI=true: {modname} cannot be imported ({e}), but pyproject.toml "
                           f"declares {declared[owner]!r}: the environment is broken, not a skip")
        if problem:  # raised outside the except block: no chained traceback in the report
            pytest.fail(problem, pytrace=False)
        return original(modname, *args, **kwargs)

    return importorskip


def install() -> None:
    """Called from tests/conftest.py's ``pytest_configure``."""
    if os.environ.get("CI", "").lower() == "true":
        pytest.importorskip = strict_importorskip(pytest.importorskip, declared_imports())
