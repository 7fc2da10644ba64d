"""Host memory and the TPU compile: what this machine has, and what a compile is expected to need.

The TPU compiler's host memory grows with the program it compiles: before batched Newton-Schulz
and the micro-batch fence, the unrolled d16 step (176,707 StableHLO ops) peaked at ~22 GiB; now
7.6 GiB over 44,388 ops unrolled, 9.3 GiB over 16,818 ops scanned (BENCHMARKS.md, "TPU
compile"): the bytes per op differ between programs. A compile that outgrows RAM + swap is
killed by the kernel after minutes of work, so the preflight estimates the need first, as
``BASE + bytes-per-op x ops`` with the bytes per op taken from the earlier compile (a cached
report) whose op count is nearest, or from the figure stated below when there is none, and
refuses up front when the estimate exceeds what is available.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from xtrain.units import GIB

# libtpu and jax loaded, before the program: the smallest steps compile at ~1.2 GiB peak here
BASE_BYTES = 1 * GIB
# stated bytes per traced StableHLO op, measured here on the unrolled v6e4 d16 2048 x 8 flash step
# before the fence: 22.2 GiB peak over 176,707 ops -> 129 KiB per op (rounded up; the fenced step
# now: 7.6 GiB over 44,388 ops, ~150 KiB per op above the base)
STATED_BYTES_PER_OP = 132 * 1024


def meminfo() -> dict[str, int]:
    """/proc/meminfo in bytes."""
    out = {}
    with open("/proc/meminfo") as f:
        for line in f:
            key, value = line.split(":", 1)
            out[key] = int(value.split()[0]) * 1024
    return out


def available_bytes(info: dict | None = None) -> int:
    """Memory a new process can have without the OOM killer: available RAM plus free swap."""
    info = info or meminfo()
    return info["MemAvailable"] + info.get("SwapFree", 0)


def earlier_compiles(report_dir: Path, libtpu: str | None) -> list[dict]:
    """(ops, peak bytes, what) of the cached reports of finished compiles with this libtpu."""
    found = []
    for path in sorted(report_dir.glob("*.json")):
        try:
            report = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        step, ops = report.get("step", {}), report.get("hlo_ops")
        if step.get("ok") and ops and step.get("host_peak_bytes") and \
                report.get("versions", {}).get("libtpu") == libtpu:
            found.append({"ops": ops, "peak": step["host_peak_bytes"],
                          "what": report.get("config", path.stem)})
    return found


def expected_bytes(ops: int, earlier: list[dict]) -> tuple[int, str]:
    """(expected peak host bytes of compiling ``ops`` StableHLO ops, where the rate came from)."""
    if earlier:
        near = min(earlier, key=lambda r: abs(math.log(r["ops"] / ops)))
        rate = max(0.0, near["peak"] - BASE_BYTES) / near["ops"]
        source = (f"the compile of {near['what']} ({near['ops']:,} ops, "
                  f"{near['peak'] / GIB:.1f} GiB peak)")
    else:
        rate, source = STATED_BYTES_PER_OP, f"the stated {STATED_BYTES_PER_OP // 1024} KiB per op"
    return int(BASE_BYTES + rate * ops), source


def refusal(ops: int, expected: int, source: str, info: dict) -> str | None:
    """Why the compile must not start (None: it may). No model setting is offered: scanned d16
    needs more host RAM than unrolled (9.3 vs 7.6 GiB; its fewer ops cost more each)."""
    available = available_bytes(info)
    if expected <= available:
        return None
    levers = ["add swap or use a machine with more RAM", "preflight.check_host_ram=false to try anyway"]
    return (f"refusing to start the TPU compile: {ops:,} StableHLO ops are expected to need "
            f"{expected / GIB:.1f} GiB of host RAM (1 GiB + {ops:,} ops at the rate of {source}), "
            f"this machine has {available / GIB:.1f} GiB available (RAM "
            f"{info['MemAvailable'] / GIB:.1f} + free swap {info.get('SwapFree', 0) / GIB:.1f}); "
            + "; ".join(levers))
