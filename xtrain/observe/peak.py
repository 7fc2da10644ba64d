"""The peak FLOP/s MFU is measured against: a TPU profile states it
(``hardware.peak_bf16_tflops_per_chip``, per chip); on this machine's CPU it is measured, unless
the profile sets it, as the best of a few square float32 matmuls (the kernel a step is made of)
with every thread torch uses. XLA's virtual CPU devices share that one CPU, so its peak is the
process's, not one device's; a run of several CPU processes (one per host) has that peak on
each of them."""

from __future__ import annotations

import time

MEASURED = "measured (float32 matmul on this CPU)"


def measured_cpu_flops(n: int = 1024, repeats: int = 5) -> float:
    """FLOP/s of an ``n x n @ n x n`` float32 matmul on the CPU, best of ``repeats``."""
    import torch

    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b  # warm-up (thread pool, allocation)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best


def run_peak_flops(hardware, devices: int, processes: int = 1) -> tuple[float, str]:
    """(peak FLOP/s of the whole run, where it comes from); 0 when unknown (no MFU logged). A
    source ending in :data:`MEASURED` is a measurement, a lower bound (the CPU may have been busy)."""
    if hardware.peak_bf16_tflops_per_chip:
        per_chip = hardware.peak_bf16_tflops_per_chip * 1e12
        return per_chip * devices, f"{hardware.peak_bf16_tflops_per_chip:g} TFLOP/s per chip (profile)"
    if hardware.accelerator_type:
        return 0.0, "unknown (hardware.peak_bf16_tflops_per_chip unset): no MFU"
    flops = measured_cpu_flops()
    each = f" x {processes} processes" if processes > 1 else ""
    return flops * processes, f"{flops / 1e9:.1f} GFLOP/s{each}, {MEASURED}"
