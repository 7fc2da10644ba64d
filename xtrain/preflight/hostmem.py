"""Host memory and the TPU compile: what this machine has, and what a compile is expected to need.

The TPU compiler's host memory grows with the program it compiles, but not in proportion: with
libtpu 0.0.21 the unrolled v6e4 d16 step peaked at 7.2 GiB over 44,308 StableHLO ops, the scanned
one at 3.9 GiB over 16,738 ops and at 2.9 GiB over 3,758 with one micro-batch (BENCHMARKS.md,
"TPU compile"). A compile that outgrows RAM + swap is killed by the kernel after minutes of work,
so the preflight estimates the need first, as ``BASE + bytes-per-op x ops``, and refuses up front
when the estimate exceeds what is available. The bytes per op come from the earlier compile (a
cached report) of the most similar program: same libtpu and compiler flags, op count within a
factor of :data:`SIMILAR_OPS`; without one, from the stated figures below. (A rate carried from
a program of another size misled: the scanned step's rate put the unrolled one at 26 GiB.)
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from xtrain.hardware import available_bytes
from xtrain.units import GIB

# A line at or above every compile in BENCHMARKS.md, "TPU compile" and "TPU preflight" (libtpu
# 0.0.21, the TPU profiles' flags): from 2.9 GiB at 3,758 ops (scanned d16) and 4.5 GiB at 12,571
# (v4-32 d16) to 8.1 GiB at 62,631. Small programs need less (~1.2 GiB: libtpu and jax loaded):
# the estimate errs on their safe side.
BASE_BYTES = int(3.5 * GIB)
STATED_BYTES_PER_OP = 90 * 1024
SIMILAR_OPS = 2.0  # an earlier compile's rate applies within this factor of its op count


def earlier_compiles(report_dir: Path, libtpu: str | None, flags: str | None) -> list[dict]:
    """(ops, peak bytes, what) of the cached reports of finished compiles with this libtpu and
    these compiler flags (LIBTPU_INIT_ARGS: inlined calls doubled one step's host memory)."""
    found = []
    for path in sorted(report_dir.glob("*.json")):
        try:
            report = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        step, ops = report.get("step", {}), report.get("hlo_ops")
        if step.get("ok") and ops and step.get("host_peak_bytes") and \
                report.get("versions", {}).get("libtpu") == libtpu and \
                report.get("libtpu_init_args") == flags:
            found.append({"ops": ops, "peak": step["host_peak_bytes"],
                          "what": report.get("config", path.stem)})
    return found


def expected_bytes(ops: int, earlier: list[dict]) -> tuple[int, str]:
    """(expected peak host bytes of compiling ``ops`` StableHLO ops, where the rate came from)."""
    def distance(r):
        return abs(math.log(r["ops"] / ops))

    near = min(earlier, key=distance, default=None)
    if near is not None and distance(near) <= math.log(SIMILAR_OPS):
        rate = max(0.0, near["peak"] - BASE_BYTES) / near["ops"]
        source = (f"the compile of {near['what']} ({near['ops']:,} ops, "
                  f"{near['peak'] / GIB:.1f} GiB peak)")
    else:
        rate, source = STATED_BYTES_PER_OP, f"the stated {STATED_BYTES_PER_OP // 1024} KiB per op"
    return int(BASE_BYTES + rate * ops), source


def refusal(ops: int, expected: int, source: str, info: dict, scanned: bool) -> str | None:
    """Why the compile must not start (None: it may), with what would let it."""
    available = available_bytes(info)
    if expected <= available:
        return None
    levers = ["add swap or use a machine with more RAM", "preflight.check_host_ram=false to try anyway"]
    if not scanned:
        levers.insert(0, "model.scan=true (the scanned d16 step compiles in about half the host "
                         "RAM: BENCHMARKS.md, \"TPU compile\")")
    return (f"refusing to start the TPU compile: {ops:,} StableHLO ops are expected to need "
            f"{expected / GIB:.1f} GiB of host RAM ({BASE_BYTES / GIB:.1f} GiB + {ops:,} ops at the "
            f"rate of {source}), this machine has {available / GIB:.1f} GiB available (RAM "
            f"{info['MemAvailable'] / GIB:.1f} + free swap {info.get('SwapFree', 0) / GIB:.1f}); "
            + "; ".join(levers))
