"""The preflight's result cache: ``<cache root>/preflight/<key>.json``.

The key covers what shapes the compiled step and nothing else, so editing metrics, logging or
evaluation code keeps 3-12 minute compiles: the step-shaping config groups and the batch, the
compiler stack's versions and flags (LIBTPU_INIT_ARGS), and the source of the modules that shape the compiled graph (the
model, the step, the optimizer, both engines, the sharding rules, the private-API shims and the
preflight's own code: its trace and compile children, what it asks them to compile and how it
reads their answers).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from xtrain.compat import installed_versions
from xtrain.config import to_plain
from xtrain.hardware import libtpu_init_args
from xtrain.paths import cache_root, write_whole

STACK = ("torch", "torch_xla", "jax", "jaxlib", "libtpu", "flax")
# relative to the xtrain package; directories stand for every .py file below them
STEP_SHAPING = ("model", "engines", "xla", "optim.py", "parallelism.py", "compat.py",
                "preflight/trace.py", "preflight/tpu_compile.py", "preflight/targets.py",
                "preflight/runner.py", "preflight/report.py")
PACKAGE = Path(__file__).resolve().parents[1]


def stack_versions() -> dict:
    return installed_versions(STACK)


def step_sources(package: Path = PACKAGE) -> list[Path]:
    files = []
    for entry in STEP_SHAPING:
        path = package / entry
        files += sorted(path.rglob("*.py")) if path.is_dir() else [path]
    return files


def cache_key(cfg, plan, package: Path = PACKAGE) -> str:
    shaping = {k: to_plain(cfg[k]) for k in ("model", "optim", "parallelism", "hardware")}
    shaping["batch"] = vars(plan.batch)
    shaping["max_steps"] = plan.max_steps  # the schedule's constants are in the graph
    shaping["versions"] = stack_versions()
    flags = libtpu_init_args(cfg.hardware)
    if flags:  # the compiler's flags, from the profile or the environment
        shaping["libtpu_init_args"] = flags
    digest = hashlib.sha256(json.dumps(shaping, sort_keys=True, default=str).encode())
    for source in step_sources(package):
        digest.update(str(source.relative_to(package)).encode() + b"\0" + source.read_bytes())
    return digest.hexdigest()[:20]


def cache_dir() -> Path:
    return cache_root() / "preflight"


def cache_path(cfg, plan) -> Path:
    return cache_dir() / f"{cache_key(cfg, plan)}.json"


def cached_report(cfg, plan) -> dict | None:
    """The stored report of this step, its planner figure the planner's of now (the key does
    not cover the planner: its estimate changes no compile)."""
    path = cache_path(cfg, plan)
    if not path.exists():
        return None
    return {**json.loads(path.read_text()), "planner_bytes": int(plan.memory.total)}


def store_report(cfg, plan, report: dict) -> None:
    # readers see the old report or the new one, never half
    write_whole(str(cache_path(cfg, plan)), json.dumps(report, indent=1).encode())
