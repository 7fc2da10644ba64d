"""Hardware profiles (conf/hardware/): the checks that a profile's facts agree with each other,
and how many devices a run spans. Starting a runtime for a profile is the XLA engine's
(xtrain/xla/runtime.py); compiling for its topology is the preflight's (xtrain/preflight/)."""

from __future__ import annotations

import os
import re

from xtrain.errors import ConfigError
from xtrain.units import GIB

# Accelerator families: TensorCores per chip, and whether the type's number counts TensorCores
# (v4-32 = 32 cores = 16 chips) or chips (v5litepod-8, v6e-4).
# single_host_chips: the largest slice that is one host (Cloud TPU docs: v5e and v6e slices of
# up to 8 chips are one VM); larger slices have 4 chips per host, as every v4 and v5p host has
TPU_FAMILIES = {
    "v4": {"cores_per_chip": 2, "name_counts": "cores", "single_host_chips": 4},
    "v5p": {"cores_per_chip": 2, "name_counts": "cores", "single_host_chips": 4},
    "v5litepod": {"cores_per_chip": 1, "name_counts": "chips", "single_host_chips": 8},
    "v6e": {"cores_per_chip": 1, "name_counts": "chips", "single_host_chips": 8},
}
CHIPS_PER_HOST_OF_A_POD = 4
REQUIRED_TPU_FACTS = ("accelerator_type", "runtime_version", "topology", "chips", "hosts",
                      "chips_per_host", "hbm_gib_per_chip", "peak_bf16_tflops_per_chip")
REQUIRED_PINS = ("torch", "torch_xla", "libtpu")


def compile_cache_enabled(compile_cache, hw) -> bool:
    """Whether the XLA engine keeps a persistent compile cache (xtrain/xla/compile_cache.py): on
    by default for TPU profiles; ``compile_cache.enabled`` decides otherwise."""
    if compile_cache.enabled is None:
        return bool(hw.accelerator_type)
    return bool(compile_cache.enabled)


def check_profile(hw) -> None:
    """A TPU profile must state every fact, and its facts must agree with each other."""
    if not hw.accelerator_type:
        if hw.engine == "xla" and hw.hosts > 1:
            raise ConfigError(f"hardware={hw.name} has hosts: {hw.hosts}, and XLA on CPU is one process "
                              "(CPU_NUM_DEVICES virtual devices): several processes train with "
                              "hardware.engine=cpu (gloo)")
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
    per_host = chips if chips <= family["single_host_chips"] else CHIPS_PER_HOST_OF_A_POD
    if (hw.hosts, hw.chips_per_host) != (chips // per_host, per_host):
        raise ConfigError(f"hardware={hw.name}: a {hw.accelerator_type} is {chips // per_host} "
                          f"host(s) of {per_host} chips, profile says {hw.hosts} x "
                          f"{hw.chips_per_host}")
    topo_chips = 1
    for dim in hw.topology.split(":")[-1].split("x"):
        topo_chips *= int(dim)
    if topo_chips != hw.chips:
        raise ConfigError(f"hardware={hw.name}: topology {hw.topology} has {topo_chips} chips, "
                          f"profile says {hw.chips}")


def run_devices(hw) -> int:
    """Devices the run spans: TPU chips, XLA-on-CPU virtual devices, or CPU processes (DDP)."""
    if hw.engine == "xla" and not hw.accelerator_type:
        value = os.environ.get("CPU_NUM_DEVICES", "1")
        if not value.isdigit() or int(value) < 1:
            raise ConfigError(f"CPU_NUM_DEVICES={value!r}: expected a positive number of virtual "
                              "XLA devices")
        return int(value)
    if hw.engine == "xla":
        return hw.chips
    return cpu_processes(hw)


def run_processes(hw, env=os.environ) -> int:
    """The run's process count: the CPU engine's (:func:`cpu_processes`), one per host on XLA."""
    return cpu_processes(hw, env) if hw.engine == "cpu" else hw.hosts


def cpu_processes(hw, env=os.environ) -> int:
    """The CPU engine's process count: WORLD_SIZE when a launcher set it (torchrun, xtrain's SSH
    launcher, or by hand), else the profile's hosts. A multi-host profile that disagrees with
    WORLD_SIZE is refused."""
    if "WORLD_SIZE" not in env:
        return hw.hosts
    world = _env_int(env, "WORLD_SIZE", minimum=1)
    if hw.hosts > 1 and world != hw.hosts:
        raise ConfigError(f"WORLD_SIZE={world} but hardware={hw.name} has {hw.hosts} hosts: start "
                          f"{hw.hosts} processes, or pick a profile with hosts: {world}")
    return world


def libtpu_init_args(hw, env=os.environ) -> str:
    """The flags a run of ``hw`` gives libtpu's compiler: ``LIBTPU_INIT_ARGS`` from the
    environment, else the profile's ``env`` (the environment wins, as in
    xtrain/xla/runtime.py ``apply_environment``)."""
    return env.get("LIBTPU_INIT_ARGS", str(hw.env.get("LIBTPU_INIT_ARGS", "")))


LAUNCH_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK")


def launch_environment(hw, env=os.environ) -> tuple[int, int, str, int]:
    """(rank, world, address, port) of this process in a multi-process CPU run, from the standard
    variables torchrun sets (and torch's env:// rendezvous reads); refuses a missing or bad one."""
    world = cpu_processes(hw, env)
    missing = [v for v in LAUNCH_VARIABLES if not env.get(v)]
    if missing:
        raise ConfigError(
            f"hardware={hw.name} runs {world} processes; {', '.join(missing)} not set: start each "
            f"process with MASTER_ADDR, MASTER_PORT, WORLD_SIZE={world} and RANK=0..{world - 1}, or "
            f"`torchrun --standalone --nproc-per-node {world} -m xtrain ...` on one machine")
    rank = _env_int(env, "RANK", minimum=0)
    if rank >= world:
        raise ConfigError(f"RANK={rank} is not below WORLD_SIZE={world}")
    return rank, world, env["MASTER_ADDR"], _env_int(env, "MASTER_PORT", minimum=1, maximum=65535)


def _env_int(env, name: str, minimum: int, maximum: int | None = None) -> int:
    # digits only: int() would also take "1_6", " 2" and other digits than ASCII's
    value = int(env[name]) if re.fullmatch(r"[0-9]+", env[name]) else None
    if value is None or value < minimum or (maximum is not None and value > maximum):
        bounds = f"in {minimum}..{maximum}" if maximum is not None else f">= {minimum}"
        raise ConfigError(f"{name}={env[name]!r}: expected an integer {bounds}")
    return value


def meminfo() -> dict[str, int]:
    """This machine's /proc/meminfo, in bytes."""
    out = {}
    with open("/proc/meminfo") as f:
        for line in f:
            key, value = line.split(":", 1)
            out[key] = int(value.split()[0]) * 1024
    return out


def available_bytes(info: dict | None = None) -> int:
    """Memory a new process can have without the OOM killer: available RAM plus free swap."""
    info = info or meminfo()
    return info["MemAvailable"] + info.get("SwapFree", 0)


def processes_here(env=os.environ) -> int:
    """The run's processes on this machine: torchrun's LOCAL_WORLD_SIZE, else this one."""
    return _env_int(env, "LOCAL_WORLD_SIZE", minimum=1) if "LOCAL_WORLD_SIZE" in env else 1


def check_fits_host(memory, devices_per_process: int = 1) -> str | None:
    """``memory`` (xtrain/plan.py MemoryPlan), the estimate per device, times the run's devices
    here (its processes, times each one's devices: XLA on CPU's virtual devices each hold their
    own share) against what this machine has. Refused when the weights, gradients and
    optimizer state alone do not fit (a run the OOM killer would end minutes into its start);
    the activations are an upper bound (the fused loss holds no logits), so a total past what is
    available is only said, as the returned line (None: it fits). (A TPU run's estimate is per
    chip, of its HBM: checked by xtrain/plan.py check_fits.)"""
    if memory.hbm:
        return None
    n, have = processes_here() * devices_per_process, available_bytes()
    here = f"{n} process(es)" if devices_per_process == 1 else f"{n} virtual XLA device(s)"
    state = (memory.weights + memory.grads + memory.optimizer) * n
    if state > have:
        raise ConfigError(
            f"does not fit this machine: {memory.describe()} x {here} here: the weights, "
            f"gradients and optimizer state alone take {state / GIB:.2f} GiB, {have / GIB:.1f} GiB "
            "are available (RAM + free swap); a smaller model, or a machine with more memory")
    if memory.total * n > have:
        return (f"may not fit this machine: {memory.total * n / GIB:.2f} GiB estimated for "
                f"{here} here (an upper bound: the activations'), {have / GIB:.1f} GiB "
                "available (RAM + free swap)")
    return None
