"""The preflight's report: reading the TPU compiler's output (collectives in the compiled HLO, its
out-of-HBM messages) and describing the result. Pure functions: the compile child uses the
parsers, the parent the rest."""

from __future__ import annotations

import re

from xtrain.units import GIB

COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")
_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4,
                "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8}


def collective_summary(hlo_text: str) -> dict[str, dict[str, int]]:
    """kind -> {count, bytes} of the collectives in a compiled (partitioned) HLO module; bytes
    are the per-device result sizes.

    Each collective is counted once: async pairs at their ``-done``, and by channel id, because
    the TPU compiler clones one all-gather into many "async collective fusions" (pieces that
    overlap it with compute) that all carry the same channel: counting text occurrences made one
    gather of a [65536, 128] table look like thirty.
    """
    out: dict[str, dict[str, int]] = {}
    op = re.compile(r"=\s+(\(.*?\)|\S+)\s+(" + "|".join(COLLECTIVES) + r")(-done)?\((.*)")
    seen: set[str] = set()
    for match in op.finditer(hlo_text):
        shape, kind, rest = match.group(1), match.group(2), match.group(4)
        channel = re.search(r"channel_id=(\d+)", rest)
        if channel:
            if channel.group(1) in seen:
                continue
            seen.add(channel.group(1))
        nbytes = 0
        for dtype, dims in re.findall(r"(\w+)\[([\d,]*)\]", shape):
            n = _DTYPE_BYTES.get(dtype, 4)
            for d in filter(None, dims.split(",")):
                n *= int(d)
            nbytes += n
        entry = out.setdefault(kind, {"count": 0, "bytes": 0})
        entry["count"] += 1
        entry["bytes"] += nbytes
    return out


def count_stablehlo_ops(text: str) -> int:
    """Operations in a StableHLO module's text (a loop body counts once, as it is compiled)."""
    return len(re.findall(r'^\s*(?:%[^=\n]*=\s*)?"?(?:stablehlo|chlo|mhlo)\.[a-z_]+', text, re.M))


def count_hlo_instructions(hlo_text: str) -> int:
    """Instructions in an HLO module's text (every computation: fusions, loop bodies...)."""
    return len(re.findall(r"^\s*(?:ROOT )?%\S+ = ", hlo_text, re.M))


def hbm_from_error(error: str) -> tuple[int, int] | None:
    """(needed at least, usable) bytes per chip from the TPU compiler's out-of-HBM errors, or None.
    Two forms: the whole program ("Ran out of memory in memory space hbm. Used 33.98G of 31.25G
    hbm.", binary units) or one buffer ("Allocation (size=34359738368) would exceed memory
    (size=33822867456)")."""
    m = re.search(r"Used ([\d.]+)([KMGT]) of ([\d.]+)([KMGT]) hbm", error)
    if m:
        scale = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
        return (int(float(m.group(1)) * scale[m.group(2)]), int(float(m.group(3)) * scale[m.group(4)]))
    m = re.search(r"Allocation \(size=(\d+)\) would exceed memory \(size=(\d+)\)", error)
    return (int(m.group(1)), int(m.group(2))) if m else None


def hbm_bytes(step: dict) -> int:
    """Per-chip bytes the compiled step needs resident."""
    return (step["argument_bytes"] + step["temp_bytes"] + step["output_bytes"]
            - step["alias_bytes"])


def describe(report: dict) -> str:
    step, cap, est = report["step"], report["hbm_bytes_per_chip"], report["planner_bytes"]
    lines = []
    if report.get("hlo_ops"):
        compiled = f", {step['hlo_instructions']:,} HLO instructions compiled" \
            if step.get("hlo_instructions") else ""
        lines.append(f"program: {report['hlo_ops']:,} StableHLO ops traced{compiled}")
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
    if not answered(report):
        lines.append("(a compile above was killed, ran out of host memory or timed out, which is "
                     "not the compiler's answer: this result is not cached, the next run compiles "
                     "again)")
    return "\n".join(lines)


def answered(report: dict) -> bool:
    """Whether every compile ended with the compiler's own answer (it fits, it does not fit, it
    does not compile), rather than the process being killed (the OOM killer, a signal), running
    out of host memory or timing out: only answers are cached as the config's verdict."""
    return all(r.get("answered", True) for r in [report["step"], *report["kernels"]])


def verdict(report: dict) -> str | None:
    """Why the run would fail on the TPU (or why that is not known), or None."""
    step = report["step"]
    if step.get("answered", True) and not step["ok"]:  # (the compiler's answer stands)
        hbm = hbm_from_error(step["error"])
        if hbm:
            return (f"does not fit: the TPU compiler needs at least {hbm[0] / GIB:.2f} GiB per chip, "
                    f"{hbm[1] / GIB:.2f} GiB are usable")
        return "the step does not compile for the TPU (the compiler's reason is above)"
    if step["ok"] and hbm_bytes(step) > report["hbm_bytes_per_chip"]:
        return (f"does not fit: the compiled step needs {hbm_bytes(step) / GIB:.2f} GiB per chip, "
                f"the chip has {report['hbm_bytes_per_chip'] / GIB:.0f} GiB")
    if not answered(report):
        return ("no verdict: a TPU compile did not finish (killed, by the out-of-memory killer or "
                "a signal, out of host memory, or past its time limit): this machine's limits, not "
                "the config's; run the same command again, with more host RAM or time")
    failed = [k["kernel"] for k in report["kernels"] if not k["ok"]]
    if failed:
        return f"the {'/'.join(failed)} attention kernel does not compile for the TPU"
    return None
