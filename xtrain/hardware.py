"""Hardware profiles at run time: how many devices a run spans, and the environment it needs."""

from __future__ import annotations

import os


def data_parallel_devices(hw) -> int:
    """Devices the global batch is split over on this engine."""
    if hw.engine == "xla" and not hw.accelerator_type:  # XLA on CPU PJRT: virtual devices
        return int(os.environ.get("CPU_NUM_DEVICES", "1"))
    if hw.engine == "xla":
        return hw.chips
    return hw.hosts  # cpu engine: one process per host (DDP over gloo when hosts > 1)
