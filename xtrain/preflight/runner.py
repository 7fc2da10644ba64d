"""``mode=compile``, the parent side: trace the step, compile it and its attention kernels for the
profile's TPU in child processes, cache and describe the report, refuse what would fail."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from omegaconf import OmegaConf

from xtrain.errors import ConfigError
from xtrain.hardware import available_bytes, libtpu_init_args, meminfo
from xtrain.preflight import hostmem
from xtrain.preflight.cache import cache_dir, cached_report, stack_versions, store_report
from xtrain.preflight.report import answered, count_stablehlo_ops, describe, verdict
from xtrain.preflight.targets import (check_can_compile, kernel_requests, topology_kwargs,
                                      trace_environment)
from xtrain.units import GIB

SOURCE_ROOT = str(Path(__file__).resolve().parents[2])  # the directory holding the xtrain package


class PreflightError(ConfigError):
    """The step does not compile or does not fit: a config problem, found before a TPU exists."""


def compile_kernel(request: dict, python: str = sys.executable, timeout: int = 600) -> dict:
    return _run_compile_child("kernel", request, python, timeout)


def lower_kernel(request: dict, out: str, python: str = sys.executable, timeout: int = 600) -> dict:
    """Only lower a kernel request to StableHLO text in ``out``, with ``python``'s jax (no
    libtpu needed): records another jax version's kernel payload (tests/fixtures/mosaic/)."""
    return _run_compile_child("lower", {**request, "out": out}, python, timeout)


def compile_step(request: dict, python: str = sys.executable, timeout: int = 3600) -> dict:
    """``request``: topology (get_topology_desc kwargs), libtpu_init_args (the run's compiler
    flags), devices, stablehlo (a file) and the trace's args/results annotations (see
    :func:`xtrain.preflight.trace.trace_step`)."""
    return _run_compile_child("step", request, python, timeout)


def _run_compile_child(kind: str, request: dict, python: str, timeout: int) -> dict:
    # JAX_PLATFORMS=cpu would hide the TPU compiler; libtpu aborts with TPU_ACCELERATOR_TYPE set
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "TPU_ACCELERATOR_TYPE")}
    env["TPU_SKIP_MDS_QUERY"] = "1"  # compile-only: no TPU metadata server
    # compile-only clients use no TPU, so several may run at once (libtpu's lock file would
    # refuse the second)
    env["ALLOW_MULTIPLE_LIBTPU_LOAD"] = "1"
    if request.get("libtpu_init_args") is not None:  # the run's compiler flags, not this shell's
        env["LIBTPU_INIT_ARGS"] = request["libtpu_init_args"]
    # the child runs in any Python that has jax/libtpu (e.g. a second environment with other
    # versions), whether or not xtrain is installed there
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [SOURCE_ROOT, env.get("PYTHONPATH")]))
    # Only a result the child printed is the compiler's answer ("answered", unless the child
    # says otherwise); a child killed by a signal (the OOM killer's SIGKILL), timed out or
    # crashed says nothing about the config.
    try:
        r = subprocess.run([python, "-m", "xtrain.preflight.tpu_compile", kind, json.dumps(request)],
                           capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"ok": False, "answered": False,
                "error": f"the TPU compiler took longer than {timeout} s"}
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    if lines:
        return {"answered": True, **json.loads(lines[-1])}
    if r.returncode == -signal.SIGKILL:  # in practice the kernel's out-of-memory killer
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB
        return {"ok": False, "answered": False,
                "error": "the compiler process was killed (SIGKILL), usually by the out-of-memory "
                         f"killer: this machine's {ram:.0f} GiB of RAM (plus swap) were too little "
                         "for this compile"}
    if r.returncode < 0:
        return {"ok": False, "answered": False, "error": "the compiler process was stopped by "
                                                         f"{signal.Signals(-r.returncode).name}"}
    tail = r.stderr.strip().splitlines()[-1] if r.stderr.strip() else ""
    return {"ok": False, "answered": False,
            "error": f"the compiler process died (exit {r.returncode}): {tail}"}


def trace(cfg, out_dir: str, python: str = sys.executable) -> dict:
    """Trace the step in a child (torch_xla reads its device count once per process); returns
    the trace's annotations, with the StableHLO in ``out_dir/step.mlir``."""
    OmegaConf.save(cfg, os.path.join(out_dir, "config.yaml"), resolve=True)
    r = subprocess.run([python, "-m", "xtrain.preflight.trace", os.path.join(out_dir, "config.yaml"),
                        out_dir], capture_output=True, text=True, env=trace_environment(cfg.hardware))
    if r.returncode != 0:
        tail = "\n".join(r.stderr.strip().splitlines()[-3:])
        raise PreflightError(f"tracing the step on XLA:CPU failed:\n{tail}")
    return json.loads(Path(out_dir, "step.json").read_text())


def check_host_memory(cfg, plan, ops: int, info: dict) -> None:
    """Refuse a compile expected to need more host memory than this machine has (``info``,
    its /proc/meminfo; xtrain/preflight/hostmem.py), before the compiler starts."""
    if not cfg.preflight.check_host_ram:
        return
    earlier = hostmem.earlier_compiles(cache_dir(), stack_versions()["libtpu"],
                                       libtpu_init_args(cfg.hardware))
    expected, source = hostmem.expected_bytes(ops, earlier)
    problem = hostmem.refusal(ops, expected, source, info, scanned=plan.gpt.scan)
    if problem:
        raise PreflightError(problem)
    print(f"host RAM: {ops:,} StableHLO ops, expected ~{expected / GIB:.1f} GiB for the compiler "
          f"(at the rate of {source}), {available_bytes(info) / GIB:.1f} GiB available",
          flush=True)


def run_preflight(cfg, plan, python: str = sys.executable) -> dict:
    """Trace, compile and measure; returns the report (cached when the compiler answered)."""
    hw, flags = cfg.hardware, libtpu_init_args(cfg.hardware)
    report: dict = {"hardware": hw.name, "config": describe_config(cfg, plan),
                    "hbm_bytes_per_chip": int(hw.hbm_gib_per_chip * GIB),
                    "planner_bytes": int(plan.memory.total), "versions": stack_versions(),
                    "libtpu_init_args": flags}
    with tempfile.TemporaryDirectory(prefix="xtrain-preflight-") as tmp:
        traced = trace(cfg, tmp, python)
        report["trace_seconds"] = traced["trace_seconds"]
        stablehlo = os.path.join(tmp, "step.mlir")
        report["hlo_ops"] = count_stablehlo_ops(Path(stablehlo).read_text())
        info = meminfo()  # the machine the compile runs on (BENCHMARKS.md states it)
        check_host_memory(cfg, plan, report["hlo_ops"], info)
        report["host"] = {"ram_bytes": info["MemTotal"], "swap_bytes": info.get("SwapTotal", 0)}
        request = {"topology": topology_kwargs(hw), "libtpu_init_args": flags,
                   "devices": traced["devices"],
                   "stablehlo": stablehlo, "args": traced["args"], "results": traced["results"]}
        report["step"] = compile_step(request, python)
    report["kernels"] = [{**req, **compile_kernel(req, python)} for req in
                         kernel_requests(hw, plan.gpt, cfg.trainer.device_batch_size)]
    if answered(report):
        store_report(cfg, plan, report)
    return report


def describe_config(cfg, plan) -> str:
    """A short name for the compiled step (what later host-memory estimates cite)."""
    g = plan.gpt
    return (f"{cfg.hardware.name} d{g.n_layer} {plan.batch.sequence_len}x"
            f"{plan.batch.device_batch_size} {g.attention}{' scan' if g.scan else ''}"
            f"{' remat' if g.remat else ''}")


def preflight(cfg, plan) -> dict:
    """``mode=compile``: print the report; raise PreflightError when the run would fail."""
    check_can_compile(cfg.hardware, plan.gpt)
    report = cached_report(cfg, plan)
    if report is not None:
        print("TPU preflight: cached result (same config, versions and step-shaping code)")
    else:
        print(f"TPU preflight: tracing the step on {cfg.hardware.chips} virtual devices, then "
              f"compiling for {cfg.hardware.topology} with libtpu (minutes for large models)",
              flush=True)
        report = run_preflight(cfg, plan)
    print(describe(report), flush=True)
    problem = verdict(report)
    if problem and problem.startswith("does not fit"):
        from xtrain.plan import describe_levers

        problem += ". Levers, by the planner: " + (describe_levers(cfg, plan)
                                                   or "none of this profile's settings")
    if problem:
        raise PreflightError(problem)
    return report
