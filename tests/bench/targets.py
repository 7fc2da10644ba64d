"""Targets a benchmark checks: a missed one is printed in its section and makes `make bench`
exit non-zero (tests/bench/__main__.py), after BENCHMARKS.md is written."""

from __future__ import annotations

MISSED: list[str] = []


def target(ok: bool, what: str) -> str:
    """Record a target's outcome; returns the word for the report."""
    if not ok:
        MISSED.append(what)
    return "met" if ok else "**MISSED**"


def same_losses(what: str, ours: list[float], baseline: list[float], rel: float = 0.0) -> float:
    """Check that xtrain and its baseline computed the same thing before a ratio of their times
    means anything: per-step losses equal within ``rel`` (relative; 0 = bitwise). Returns the
    worst relative difference; raises with both lists otherwise."""
    if len(ours) != len(baseline) or not ours:
        raise AssertionError(f"{what}: {len(ours)} vs {len(baseline)} losses recorded")
    worst = max(abs(a - b) / abs(b) for a, b in zip(ours, baseline))
    if worst > rel:
        raise AssertionError(f"{what}: losses differ by {worst:.2e} relative (allowed {rel:.0e}), "
                             f"so the two runs did different work:\n{ours}\nvs\n{baseline}")
    return worst
