"""TPU preflight (mode=compile) on the real runs' configs: per-chip HBM from the TPU compiler vs the
planner's estimate, compile time, and the config that must not fit."""

from __future__ import annotations

import time

from tests.bench.targets import target
from xtrain.units import GIB

COMMAND = "make bench ARGS=preflight   (python -m tests.bench preflight)"
CONFIGS = [  # the known-good real runs, then one that cannot fit
    ["hardware=v5e8", "model=d16", "data=base_data_v3"],  # seq 1024, batch 8 (sdpa)
    ["hardware=v6e4", "model=d16", "data=base_data_v3"],  # seq 2048, batch 8 (flash)
    # why attention=auto picks flash at 2048 on TPU: with SDPA the same step does not fit
    ["hardware=v6e4", "model=d16", "data=base_data_v3", "model.attention=sdpa"],
    ["hardware=v5e8", "model=d26", "data=cpp16k"],  # seq 16384 without sharding: must not fit
    ["hardware=v6e4", "model=d16", "data=cpp16k"],  # seq 16384, batch 1, flash attention
    # sliding windows on 3 of 4 layers: splash kernels inside the step
    ["hardware=v6e4", "model=d16", "data=base_data_v3", "model.window_pattern=SSSL"],
    ["hardware=v4_32", "model=d16"],  # a 4-host pod: the step over 16 chips of v4:2x2x4
]
TOLERANCE = 0.25


def _meminfo_gib(field: str) -> int:
    with open("/proc/meminfo") as f:
        kib = next(int(line.split()[1]) for line in f if line.startswith(field + ":"))
    return round(kib / 2**20)


def run() -> str:
    from tests.conftest import compose_cfg
    from xtrain.preflight.cache import cached_report
    from xtrain.preflight.report import hbm_bytes, hbm_from_error, verdict
    from xtrain.preflight.runner import run_preflight
    from xtrain.plan import resolve

    rows = []
    for overrides in CONFIGS:
        cfg = compose_cfg([*overrides, "mode=compile"])
        plan = resolve(cfg, cfg.hardware.chips)
        t0 = time.time()
        report = cached_report(cfg, plan)  # same config, versions and xtrain source: reuse
        cached = report is not None
        report = report or run_preflight(cfg, plan)
        wall = f"{time.time() - t0:.0f}" if not cached else "cached"
        step = report["step"]
        est = report["planner_bytes"] / GIB
        if step["ok"]:
            need = hbm_bytes(step) / GIB
            compiler = f"{need:.2f}"
            ratio = f"{est / need:.2f}"
            within = target(abs(est / need - 1) <= TOLERANCE, f"preflight: planner within "
                            f"±{TOLERANCE:.0%} of the compiler, {' '.join(overrides)}")
        elif hbm_from_error(step["error"]):  # out of HBM: the compiler states what it needed
            need = hbm_from_error(step["error"])[0] / GIB
            compiler = f">= {need:.2f} (OOM)"
            ratio = f"<= {est / need:.2f}"
            # the compiler stops counting at OOM: a planner far below its lower bound is a miss
            within = (target(False, f"preflight: planner below the compiler's OOM lower bound, "
                             f"{' '.join(overrides)}")
                      if est / need < 1 - TOLERANCE else "n/a: the compiler stops counting at OOM")
        else:
            compiler, ratio, within = "error", "-", "-"
        problem = verdict(report) or "fits"
        kernels = ", ".join(f"{k['kernel']} {'ok' if k['ok'] else 'FAILED'}" for k in report["kernels"]) or "-"
        host = f"{step['host_peak_bytes'] / GIB:.1f}" if step["ok"] else "-"
        rows.append(f"| {' '.join(overrides)} | {plan.batch.sequence_len} x {plan.batch.device_batch_size} "
                    f"| {plan.attention} | {compiler} | {est:.2f} | {ratio} | {within} | {problem} "
                    f"| {kernels} | {step.get('seconds', '-')} / {wall} | {host} |")
        print(rows[-1], flush=True)
        if not step["ok"]:
            rows.append(f"|  | compiler: {step['error'][:300].splitlines()[0]} ||||||||||")
    return "\n".join([
        "## TPU preflight: compiler HBM vs the planner's estimate",
        "",
        f"`{COMMAND}`. Each config's training step traced on XLA:CPU and compiled by libtpu "
        "for the profile's topology (no TPU). HBM per chip = arguments + temporaries + outputs - "
        "aliases, GiB; on an out-of-HBM failure the compiler reports a lower bound. Target: the "
        f"planner within ±{TOLERANCE:.0%} of the compiler. `cached`: the report of an earlier run "
        "of this command with the same config, versions and xtrain source. This machine: "
        f"{_meminfo_gib('MemTotal')} GiB RAM, {_meminfo_gib('SwapTotal')} GiB swap (the compiler's "
        "host RAM column is its peak resident memory, so it stops at the RAM; beyond that it "
        "used swap).",
        "",
        "| config | seq x device batch | attention | compiler GiB | planner GiB | planner/compiler | "
        "within | verdict | kernels | compile s / total s | compiler host RAM GiB |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
        *rows,
    ])
