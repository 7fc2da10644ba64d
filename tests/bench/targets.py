"""Targets a benchmark checks: a missed one is printed in its section and makes `make bench`
exit non-zero (tests/bench/__main__.py), after BENCHMARKS.md is written."""

from __future__ import annotations

MISSED: list[str] = []


def target(ok: bool, what: str) -> str:
    """Record a target's outcome; returns the word for the report."""
    if not ok:
        MISSED.append(what)
    return "met" if ok else "**MISSED**"
