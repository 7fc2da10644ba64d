"""Starting torch_xla for a hardware profile: the profile's environment (set before torch_xla
reads it), SPMD mode, the check that refuses a runtime that is not the profile's (no silent
CPU fallback), and this host's place among the run's hosts."""

from __future__ import annotations

import os
from datetime import timedelta

from xtrain.compat import installed_versions
from xtrain.errors import ConfigError
from xtrain.hardware import REQUIRED_PINS

_started = False
_cache = None


def apply_environment(hw) -> dict[str, str]:
    """Export the profile's environment; must run before torch_xla initialises its runtime.
    Variables already set in the environment win (so a profile can be debugged without editing
    it)."""
    applied = {}
    for key, value in hw.env.items():
        if key not in os.environ:
            os.environ[key] = str(value)
            applied[key] = str(value)
    return applied


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


def start_runtime(hw, compile_analysis: str | None = None, compile_cache=None):
    """Environment first, then the persistent compile cache, then SPMD mode, before any XLA
    tensor exists (order matters: torch_xla reads PJRT_DEVICE, XLA_* and the cache's location
    once, and use_spmd() must precede the first device tensor). ``compile_analysis``: a file where
    torch_xla explains every compilation. Returns the compile cache
    (xtrain/xla/compile_cache.py), or None."""
    global _started, _cache
    if _started:
        return _cache
    apply_environment(hw)
    if compile_analysis:
        os.environ.setdefault("PT_XLA_DEBUG_LEVEL", "1")
        os.environ.setdefault("PT_XLA_DEBUG_FILE", compile_analysis)
    if not hw.accelerator_type:
        os.environ.setdefault("PJRT_DEVICE", "CPU")  # XLA on CPU PJRT: the test/try-out path
    if compile_cache is not None:
        from xtrain.xla.compile_cache import start_cache

        _cache = start_cache(compile_cache, hw)
    import torch_xla.runtime as xr

    xr.use_spmd()
    check_runtime(hw)
    _started = True
    return _cache


def host_processes(timeout_s: float):
    """This host's place among the run's hosts (torch_xla's process index and count, one process
    per host) and gloo groups across them for what happens outside the compiled step (barriers,
    broadcasts, stop votes, checkpoint saves): xtrain/engines/processes.py.

    The seam tests replace: a multi-host TPU runtime cannot exist on this machine (torch_xla's
    CPU runtime does no cross-process collectives), so tests/test_multihost_xla.py stands in a
    runtime reporting another process index and checks what such a host does.
    """
    import torch_xla.runtime as xr

    from xtrain.engines.processes import Processes, joined, waiting_for_signals

    rank, world = xr.process_index(), xr.process_count()
    check_launch_order(rank, world)
    if world == 1:
        return Processes()
    import torch.distributed as dist

    from xtrain.errors import PeerLost

    if not dist.is_initialized():  # torch_xla's xla:// rendezvous finds the hosts itself
        try:
            waiting_for_signals(lambda: dist.init_process_group(
                "gloo", init_method="xla://", timeout=timedelta(seconds=timeout_s)))
        except dist.DistError as e:  # (torch_xla's store waits its own 300 s, whatever timeout_s)
            raise PeerLost(f"not every host of {world} joined host 0's store: a host that was not "
                           f"started, or that ended at start (its log says why) ({type(e).__name__}: "
                           f"{str(e).splitlines()[0][:200]})") from e
    return joined(rank, world, timeout_s)


def check_launch_order(rank: int, world: int, environ=os.environ) -> None:
    """The launchers number the hosts (RANK, WORLD_SIZE; rank 0 holds the run dir's lock and
    writes its record) and the TPU runtime numbers them too (process 0 writes the metrics and
    commits checkpoints): refuse a host whose numbers disagree, or two hosts would each do half
    of process 0's work."""
    given = environ.get("RANK"), environ.get("WORLD_SIZE")
    if given != (None, None) and given != (str(rank), str(world)):
        raise ConfigError(f"this host was launched as RANK={given[0]} of WORLD_SIZE={given[1]}, and "
                          f"the XLA runtime counts it process {rank} of {world}: a TPU slice numbers "
                          "its hosts by worker (list them in gcloud's worker order); XLA on CPU is "
                          "one process (several: hardware.engine=cpu)")
