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


def tpu_chips_on_pci() -> int:
    """TPU chips attached to this host, read from the PCI bus (no network, no runtime init)."""
    try:
        from torch_xla._internal.tpu import num_available_chips
    except ImportError:
        return 0
    return num_available_chips()


def quiet_lightning_tpu_probe() -> None:
    """Lightning's Trainer logs ``XLAAccelerator.is_available()`` on every construction; off-TPU
    that probe queries the GCE metadata server and, with some TPU_* variables set (jax/libtpu set
    them), raises instead of returning False (see DESIGN.md). Answer it from the PCI bus."""
    from lightning.pytorch.accelerators import XLAAccelerator

    if not getattr(XLAAccelerator.is_available, "_xtrain", False):
        def is_available() -> bool:
            return tpu_chips_on_pci() > 0

        is_available._xtrain = True
        XLAAccelerator.is_available = staticmethod(is_available)
