"""``make bench``: run the benchmarks and rewrite BENCHMARKS.md.

Every number is a ratio against a baseline measured in the same command on the same machine
(this machine is noisy: absolute numbers are printed for context only).
Usage: python -m tests.bench [NAME ...]   (default: all)
"""

from __future__ import annotations

import datetime
import os
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


def cpu_name() -> str:
    """The processor as Linux names it, with its family and model (a cloud VM's name alone, such
    as "AMD EPYC", says little), or ``platform.processor()`` elsewhere."""
    try:
        fields = dict(line.split(":", 1) for line in Path("/proc/cpuinfo").read_text().splitlines()
                      if ":" in line)
    except OSError:
        return platform.processor() or platform.machine()
    fields = {k.strip(): v.strip() for k, v in fields.items()}
    return (f"{fields.get('model name', '?')} "
            f"(family {fields.get('cpu family', '?')}, model {fields.get('model', '?')})")


def machine_stamp() -> str:
    """Where and when a section was measured: the machine's speed differs between CPUs by far more
    than the effects measured, so a section's ratios compare only within it."""
    return (f"_Measured {datetime.date.today().isoformat()} on {cpu_name()}, {os.cpu_count()} "
            f"logical cores, Python {platform.python_version()}._")


def write(sections: dict[str, str]) -> None:
    """Replace each benchmark's section in BENCHMARKS.md, keeping the others; a section written
    now ends with the machine it ran on."""
    text = OUT.read_text() if OUT.exists() else ""
    head, _, _ = text.partition("\n<!-- bench:")
    existing = {}
    for block in text.split("\n<!-- bench:")[1:]:
        key, _, body = block.partition(" -->\n")
        existing[key] = body.rstrip("\n")
    existing.update({k: f"{v.rstrip()}\n\n{machine_stamp()}" for k, v in sections.items()})
    stamp = (f"_Machine: {platform.machine()}, {platform.python_version()}, "
             f"updated {datetime.date.today().isoformat()}._\n")
    body = "".join(f"\n<!-- bench:{k} -->\n{v}\n" for k, v in sorted(existing.items()))
    if "_Machine:" in head:
        head = head[:head.index("_Machine:")]
    OUT.write_text(head.rstrip("\n") + "\n\n" + stamp + body)


if __name__ == "__main__":
    main(sys.argv[1:])
