"""``make bench``: run the benchmarks and rewrite BENCHMARKS.md.

Every number is a ratio against a baseline measured in the same command on the same machine
(this machine is noisy: absolute numbers are printed for context only).
Usage: python -m tests.bench [NAME ...]   (default: all)
"""

from __future__ import annotations

import datetime
import platform
import sys
from pathlib import Path

from tests.bench import (attention, checkpoint, compile_time, cpp_eval, cpu_peer, generate, launch,
                         loader, preflight, step_time, stop_vote, xla_step)
from tests.bench.targets import MISSED

BENCHES = {"step_time": step_time.run, "attention": attention.run, "loader": loader.run,
           "xla_step": xla_step.run, "checkpoint": checkpoint.run, "preflight": preflight.run,
           "cpp_eval": cpp_eval.run, "launch": launch.run, "generate": generate.run,
           "stop_vote": stop_vote.run, "compile": compile_time.run, "cpu_peer": cpu_peer.run}
OUT = Path(__file__).resolve().parents[2] / "BENCHMARKS.md"


def main(argv: list[str]) -> None:
    names = argv or list(BENCHES)
    sections = {}
    for name in names:
        print(f"== {name}", flush=True)
        sections[name] = BENCHES[name]()
        print(sections[name], flush=True)
    write(sections)
    if MISSED:
        sys.exit("targets missed: " + "; ".join(MISSED))


def write(sections: dict[str, str]) -> None:
    """Replace each benchmark's section in BENCHMARKS.md, keeping the others."""
    text = OUT.read_text() if OUT.exists() else ""
    head, _, _ = text.partition("\n<!-- bench:")
    existing = {}
    for block in text.split("\n<!-- bench:")[1:]:
        key, _, body = block.partition(" -->\n")
        existing[key] = body.rstrip("\n")
    existing.update({k: v.rstrip("\n") for k, v in sections.items()})
    stamp = (f"_Machine: {platform.machine()}, {platform.python_version()}, "
             f"updated {datetime.date.today().isoformat()}._\n")
    body = "".join(f"\n<!-- bench:{k} -->\n{v}\n" for k, v in sorted(existing.items()))
    if "_Machine:" in head:
        head = head[:head.index("_Machine:")]
    OUT.write_text(head.rstrip("\n") + "\n\n" + stamp + body)


if __name__ == "__main__":
    main(sys.argv[1:])
