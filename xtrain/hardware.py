"""Hardware profiles at run time: validation of a profile's facts, how many devices a run spans,
the environment a TPU run needs (set before torch_xla initialises), and the runtime check that
refuses a run whose runtime is not the one the profile names (no silent CPU fallback)."""

from __future__ import annotations

import os
import re
from importlib import metadata

from xtrain.config import ConfigError

# Accelerator families: TensorCores per chip, and whether the type's number counts TensorCores
# (v4-32 = 32 cores = 16 chips) or chips (v5litepod-8, v6e-4).
TPU_FAMILIES = {
    "v4": {"cores_per_chip": 2, "name_counts": "cores"},
    "v5p": {"cores_per_chip": 2, "name_counts": "cores"},
    "v5litepod": {"cores_per_chip": 1, "name_counts": "chips"},
    "v6e": {"cores_per_chip": 1, "name_counts": "chips"},
}
REQUIRED_TPU_FACTS = ("accelerator_type", "runtime_version", "topology", "chips", "hosts",
                      "chips_per_host", "hbm_gib_per_chip", "peak_bf16_tflops_per_chip")
REQUIRED_PINS = ("torch", "torch_xla", "libtpu")


def check_profile(hw) -> None:
    """A TPU profile must state every fact, and its facts must agree with each other."""
    if hw.engine not in ("cpu", "xla"):
        raise ConfigError(f"hardware.engine={hw.engine!r}: expected cpu or xla")
    if hw.precision not in ("float32", "bfloat16"):
        raise ConfigError(f"hardware.precision={hw.precision!r}: expected float32 or bfloat16")
    if not hw.accelerator_type:
        return
    missing = [f for f in REQUIRED_TPU_FACTS if not hw[f]]
    missing += [f"pins.{p}" for p in REQUIRED_PINS if p not in hw.pins]
    if missing:
        raise ConfigError(f"hardware={hw.name} is missing {', '.join('hardware.' + m for m in missing)}")
    m = re.fullmatch(r"(v4|v5p|v5litepod|v6e)-(\d+)", hw.accelerator_type)
    if not m:
        raise ConfigError(f"hardware.accelerator_type={hw.accelerator_type!r}: unknown TPU type "
                          f"(known families: {', '.join(f + '-N' for f in TPU_FAMILIES)})")
    family, n = TPU_FAMILIES[m.group(1)], int(m.group(2))
    chips = n // family["cores_per_chip"] if family["name_counts"] == "cores" else n
    if hw.chips != chips:
        raise ConfigError(f"hardware={hw.name}: {hw.accelerator_type} has {chips} chips "
                          f"({family['name_counts']} counted in the name), profile says {hw.chips}")
    if hw.cores_per_chip != family["cores_per_chip"]:
        raise ConfigError(f"hardware={hw.name}: {m.group(1)} chips have {family['cores_per_chip']} "
                          f"TensorCores, profile says {hw.cores_per_chip}")
    if hw.hosts * hw.chips_per_host < hw.chips or hw.chips_per_host * (hw.hosts - 1) >= hw.chips:
        raise ConfigError(f"hardware={hw.name}: {hw.hosts} hosts x {hw.chips_per_host} chips per "
                          f"host does not hold exactly {hw.chips} chips")
    topo_chips = 1
    for dim in hw.topology.split(":")[-1].split("x"):
        topo_chips *= int(dim)
    if topo_chips != hw.chips:
        raise ConfigError(f"hardware={hw.name}: topology {hw.topology} has {topo_chips} chips, "
                          f"profile says {hw.chips}")


def run_devices(hw) -> int:
    """Devices the run spans: TPU chips, XLA-on-CPU virtual devices, or CPU hosts (DDP)."""
    if hw.engine == "xla" and not hw.accelerator_type:
        return int(os.environ.get("CPU_NUM_DEVICES", "1"))
    if hw.engine == "xla":
        return hw.chips
    return hw.hosts


def apply_environment(hw) -> dict[str, str]:
    """Export the profile's environment; must run before torch_xla initialises its runtime.
    Variables the user set explicitly win (so a profile can be debugged without editing it)."""
    applied = {}
    for key, value in hw.env.items():
        if key not in os.environ:
            os.environ[key] = str(value)
            applied[key] = str(value)
    return applied


def installed_versions(packages) -> dict[str, str | None]:
    out = {}
    for package in packages:
        try:
            out[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            out[package] = None
    return out


def runtime_mismatches(hw, device_type: str, device_count: int, versions: dict) -> list[str]:
    """Why this process cannot run ``hw`` (empty: it can). Pure, so it is testable off-TPU."""
    problems = []
    want = "TPU" if hw.accelerator_type else "CPU"
    if hw.engine == "xla" and device_type != want:
        problems.append(f"the XLA runtime is {device_type}, hardware={hw.name} needs {want} "
                        "(is this the TPU VM? is PJRT_DEVICE overridden?)")
    if hw.accelerator_type and device_count != hw.chips:
        problems.append(f"{device_count} devices visible, hardware={hw.name} has {hw.chips} chips")
    for package, pinned in hw.pins.items():
        found = versions.get(package)
        if found is not None and found.split("+")[0] != str(pinned):
            problems.append(f"{package}=={found} installed, hardware={hw.name} pins {pinned}")
        if found is None and package in REQUIRED_PINS and hw.accelerator_type:
            problems.append(f"{package} is not installed (hardware={hw.name} pins {pinned})")
    return problems


def check_runtime(hw) -> None:
    """After torch_xla initialised: refuse a runtime that is not the one the profile names."""
    import torch_xla.runtime as xr

    problems = runtime_mismatches(hw, xr.device_type(), xr.global_runtime_device_count(),
                                  installed_versions(hw.pins))
    if problems:
        raise ConfigError("refusing to run: " + "; ".join(problems))


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


def topology_kwargs(hw) -> dict:
    """Arguments for ``jax.experimental.topologies.get_topology_desc`` for this profile. Slices
    smaller than libtpu's default host bounds (2x2x1), e.g. v6e-1, must state their own; chips
    with two TensorCores (v4, v5p) run as one megacore device each, as torch_xla sees them
    (libtpu's default config would list every TensorCore as a device)."""
    kwargs = {"platform": "tpu", "topology_name": hw.topology}
    if hw.cores_per_chip > 1:
        kwargs["chip_config_name"] = "megacore"
    if hw.chips_per_host < 4:
        dims = [int(d) for d in hw.topology.split(":")[1].split("x")]
        kwargs["chips_per_host_bounds"] = tuple((dims + [1, 1])[:3])
    return kwargs
