"""``mode=compile``: the TPU preflight. Know that a run compiles and fits before renting a TPU.

1. Trace the config's training step on XLA:CPU over as many virtual devices as the profile has
   chips (:mod:`xtrain.xla.trace`, a child process: torch_xla reads its device count once).
2. Compile it for the profile's TPU topology with libtpu (:mod:`xtrain.tpu_compile`, a child).
3. Compile the attention kernels the config uses on the TPU at their real shapes, on their own,
   so a Pallas/libtpu version mismatch is reported with the compiler's reason.

Per-chip HBM is arguments + temporaries + outputs - aliases (donated buffers), the figure the TPU
runtime needs; it is compared with the profile's HBM and with the planner's estimate. Results are
cached under ``$XTRAIN_CACHE/preflight`` by a hash of the step-shaping config, the versions of
the compiler stack and xtrain's own source, so re-planning reads them back instantly
(``mode=plan`` prints the cached figure next to the estimate).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from omegaconf import OmegaConf

from xtrain.config import ConfigError
from xtrain.tpu_compile import hbm_from_error

GIB = 1024**3
STACK = ("torch", "torch_xla", "jax", "jaxlib", "libtpu", "flax")


class PreflightError(ConfigError):
    """The step does not compile or does not fit: a config problem, found before a TPU exists."""


def cache_dir() -> Path:
    return Path(os.environ.get("XTRAIN_CACHE", Path.home() / ".cache" / "xtrain")) / "preflight"


def cache_key(cfg, plan) -> str:
    """What shapes the compiled step: model, optimizer, parallelism, hardware, the batch; plus
    the compiler stack's versions and xtrain's source (a code change can change the graph)."""
    shaping = {k: OmegaConf.to_container(cfg[k], resolve=True)
               for k in ("model", "optim", "parallelism", "hardware")}
    shaping["batch"] = vars(plan.batch)
    shaping["max_steps"] = plan.max_steps  # the schedule's constants are in the graph
    shaping["versions"] = _stack_versions()
    digest = hashlib.sha256(json.dumps(shaping, sort_keys=True, default=str).encode())
    for source in sorted(Path(__file__).parent.rglob("*.py")):
        digest.update(source.read_bytes())
    return digest.hexdigest()[:20]


def _cache_path(cfg, plan) -> Path:
    return cache_dir() / f"{cache_key(cfg, plan)}.json"


def cached_report(cfg, plan) -> dict | None:
    path = _cache_path(cfg, plan)
    return json.loads(path.read_text()) if path.exists() else None


def hbm_bytes(step: dict) -> int:
    """Per-chip bytes the compiled step needs resident."""
    return (step["argument_bytes"] + step["temp_bytes"] + step["output_bytes"]
            - step["alias_bytes"])


def check_can_compile(cfg, plan) -> None:
    """Refuse early, before any tracing, what cannot be preflighted here."""
    from xtrain.model.attention import tpu_kernel
    from xtrain.plan import model_shape

    hw = cfg.hardware
    if not hw.accelerator_type or hw.engine != "xla":
        raise ConfigError(f"mode=compile compiles for a TPU: hardware={hw.name} is not a TPU "
                          "profile (try hardware=v6e4)")
    needed = ["jax", "jaxlib", "libtpu"]
    if any(tpu_kernel(plan.attention, w) == "splash" for w in model_shape(cfg.model)["windows"]):
        needed.append("flax")  # splash goes through call_jax -> torch_xla's torchax -> flax
    versions = _stack_versions()
    missing = [p for p in needed if versions[p] is None]
    if missing:
        raise ConfigError(f"mode=compile needs {', '.join(missing)} (pip install 'xtrain[tpu]')")


def _stack_versions() -> dict:
    from xtrain.hardware import installed_versions

    return installed_versions(STACK)


def trace_environment(hw) -> dict[str, str]:
    """The trace child's environment: XLA on CPU with one virtual device per chip, JAX on CPU,
    the profile's other settings (they shape the graph), and nothing that would wake libtpu."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TPU_")}
    env.update({k: str(v) for k, v in hw.env.items()})
    env.update(PJRT_DEVICE="CPU", CPU_NUM_DEVICES=str(hw.chips), JAX_PLATFORMS="cpu")
    return env


def run_preflight(cfg, plan, python: str = sys.executable) -> dict:
    """Trace, compile and measure; returns the report (also cached)."""
    from xtrain.hardware import topology_kwargs
    from xtrain.plan import model_shape
    from xtrain.tpu_compile import compile_kernel, compile_step, kernel_requests

    hw = cfg.hardware
    report: dict = {"hardware": hw.name, "hbm_bytes_per_chip": int(hw.hbm_gib_per_chip * GIB),
                    "planner_bytes": int(plan.memory.total), "versions": _stack_versions()}
    with tempfile.TemporaryDirectory(prefix="xtrain-preflight-") as tmp:
        OmegaConf.save(cfg, os.path.join(tmp, "config.yaml"), resolve=True)
        r = subprocess.run([python, "-m", "xtrain.xla.trace", os.path.join(tmp, "config.yaml"), tmp],
                           capture_output=True, text=True, env=trace_environment(hw))
        if r.returncode != 0:
            tail = "\n".join(r.stderr.strip().splitlines()[-3:])
            raise PreflightError(f"tracing the step on XLA:CPU failed:\n{tail}")
        traced = json.loads(Path(tmp, "step.json").read_text())
        report["trace_seconds"] = traced["trace_seconds"]
        request = {"topology": topology_kwargs(hw), "devices": traced["devices"],
                   "stablehlo": os.path.join(tmp, "step.mlir"), "args": traced["args"],
                   "results": traced["results"]}
        report["step"] = compile_step(request, python)
    report["kernels"] = [{**req, **compile_kernel(req, python)} for req in
                         kernel_requests(hw, model_shape(cfg.model), plan.attention,
                                         cfg.trainer.device_batch_size)]
    path = _cache_path(cfg, plan)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp_path = path.with_suffix(".tmp")
    tmp_path.write_text(json.dumps(report, indent=1))
    os.replace(tmp_path, path)
    return report


def describe(report: dict) -> str:
    step, cap, est = report["step"], report["hbm_bytes_per_chip"], report["planner_bytes"]
    lines = []
    if step["ok"]:
        need = hbm_bytes(step)
        lines.append(f"TPU compile ({report['hardware']}, libtpu {report['versions']['libtpu']}): "
                     f"ok in {step['seconds']:.1f} s, {step['host_peak_bytes'] / GIB:.1f} GiB of "
                     "host RAM")
        lines.append(f"HBM/chip (compiler): {need / GIB:.2f} GiB of {cap / GIB:.0f} GiB "
                     f"({need / cap:.0%}) = arguments {step['argument_bytes'] / GIB:.2f} + temporaries "
                     f"{step['temp_bytes'] / GIB:.2f} + outputs {step['output_bytes'] / GIB:.2f} - "
                     f"aliased {step['alias_bytes'] / GIB:.2f}")
        lines.append(f"HBM/chip (planner):  {est / GIB:.2f} GiB ({est / need - 1:+.0%} vs the compiler)")
        lines.append(f"FLOPs/step/chip (compiler): {step['flops']:.3e}")
        coll = ", ".join(f"{k} x{v['count']} ({v['bytes'] / GIB:.2f} GiB)"
                         for k, v in sorted(step["collectives"].items())) or "none"
        lines.append(f"collectives/step/chip: {coll}")
    elif hbm_from_error(step["error"]):
        used, usable = hbm_from_error(step["error"])
        lines.append(f"TPU compile ({report['hardware']}): out of HBM")
        lines.append(f"HBM/chip (compiler): at least {used / GIB:.2f} GiB of {usable / GIB:.2f} GiB "
                     f"usable ({used / usable:.0%})")
        lines.append(f"HBM/chip (planner):  {est / GIB:.2f} GiB ({est / used - 1:+.0%} vs the compiler)")
        lines.append("compiler's report:\n  " + "\n  ".join(step["error"].splitlines()[:40]))
    else:
        lines.append(f"TPU compile ({report['hardware']}): FAILED\n  {step['error']}")
    for k in report["kernels"]:
        what = f"{k['kernel']} kernel {'x'.join(map(str, k['shape']))}" + (
            f" window {k['window']}" if k["window"] else "")
        lines.append(f"{what}: " + (f"ok in {k['seconds']:.1f} s" if k["ok"] else f"FAILED: {k['error']}"))
    return "\n".join(lines)


def verdict(report: dict) -> str | None:
    """Why the run would fail on the TPU, or None."""
    step = report["step"]
    if not step["ok"]:
        hbm = hbm_from_error(step["error"])
        if hbm:
            return (f"does not fit: the TPU compiler needs at least {hbm[0] / GIB:.2f} GiB per chip, "
                    f"{hbm[1] / GIB:.2f} GiB are usable")
        return "the step does not compile for the TPU (the compiler's reason is above)"
    if hbm_bytes(step) > report["hbm_bytes_per_chip"]:
        return (f"does not fit: the compiled step needs {hbm_bytes(step) / GIB:.2f} GiB per chip, "
                f"the chip has {report['hbm_bytes_per_chip'] / GIB:.0f} GiB")
    failed = [k["kernel"] for k in report["kernels"] if not k["ok"]]
    if failed:
        return f"the {'/'.join(failed)} attention kernel does not compile for the TPU"
    return None


def preflight(cfg, plan) -> dict:
    """``mode=compile``: print the report; raise PreflightError when the run would fail."""
    check_can_compile(cfg, plan)
    report = cached_report(cfg, plan)
    if report is not None:
        print("TPU preflight: cached result (same config, versions and code)")
    else:
        print(f"TPU preflight: tracing the step on {cfg.hardware.chips} virtual devices, then "
              f"compiling for {cfg.hardware.topology} with libtpu (minutes for large models)",
              flush=True)
        report = run_preflight(cfg, plan)
    print(describe(report), flush=True)
    problem = verdict(report)
    if problem:
        raise PreflightError(problem)
    return report
