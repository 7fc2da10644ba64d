"""tests/worker_groups.py's groups hold under the installed pytest and pytest-xdist: pytest 9.2
changed how node ids are kept and pytest-xdist 3.8's ``--dist loadgroup`` then silently grouped
nothing (the loopback-host tests ran on both workers at once; each module fixture was made twice)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent

CONFTEST = '''
import pytest

from worker_groups import group_items


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items):
    group_items(items)
'''

TESTS_FILE = '''
import os
from pathlib import Path

import pytest


def note(kind, i):
    Path(os.environ["WORKERS_SEEN"], f"{kind}-{i}").write_text(os.environ["PYTEST_XDIST_WORKER"])


@pytest.fixture(scope="module")
def made_once():
    return object()


@pytest.fixture(scope="session")
def sshd():
    return object()


@pytest.mark.parametrize("i", range(6))
def test_of_a_module_fixture(made_once, i):
    note("module", i)


@pytest.mark.parametrize("i", range(6))
def test_of_the_hosts(sshd, i):
    note("hosts", i)


@pytest.mark.parametrize("i", range(6))
def test_free(i):
    note("free", i)
'''


def test_a_module_fixtures_tests_and_the_loopback_hosts_tests_each_share_one_worker(tmp_path):
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "test_inner.py").write_text(TESTS_FILE)
    seen = tmp_path / "seen"
    seen.mkdir()
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2",
                        "--dist", "loadgroup", str(tmp_path)], cwd=tmp_path, capture_output=True,
                       text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": str(TESTS), "WORKERS_SEEN": str(seen)})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    workers = {kind: {p.read_text() for p in seen.glob(f"{kind}-*")} for kind in ("module", "hosts")}
    assert len(list(seen.iterdir())) == 18
    assert [len(w) for w in workers.values()] == [1, 1], workers
