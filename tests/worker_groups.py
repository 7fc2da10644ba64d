"""Which tests share a pytest-xdist worker under `make test` (``--dist loadgroup``): every test
that reaches the loopback hosts (tests/sshd.py), since the hosts are this one machine for both
workers and a launch refuses a host that is busy with another job; and the tests of one
module-scoped fixture (a training run, a sweep: 15 to 45 s each), which that worker then makes
once."""

from __future__ import annotations

import pytest


def group_items(items) -> None:
    """Mark ``items`` with their ``xdist_group``; to be called before pytest-xdist reads the marks
    (a ``tryfirst`` pytest_collection_modifyitems)."""
    for item in items:
        if "sshd" in item.fixturenames:
            item.add_marker(pytest.mark.xdist_group("loopback-hosts"))
            continue
        defs = item._fixtureinfo.name2fixturedefs  # (pytest's own record of the item's fixtures)
        shared = [name for name in item.fixturenames
                  if name in defs and defs[name][-1].scope == "module"]
        if shared:
            item.add_marker(pytest.mark.xdist_group(f"{item.module.__name__}:{shared[0]}"))
