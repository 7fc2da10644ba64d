"""What the preflight compiles, and where: the profile's TPU topology for the compile-only client,
the attention kernels the config's layers use, and the trace child's environment."""

from __future__ import annotations

import os

from xtrain.errors import ConfigError
from xtrain.hardware import libtpu_init_args
from xtrain.model.config import tpu_kernel
from xtrain.preflight.cache import stack_versions


def topology_kwargs(hw) -> dict:
    """Arguments for ``jax.experimental.topologies.get_topology_desc`` for this profile. A slice
    of one host states its host bounds (the whole slice): libtpu's default (2x2x1) would split a
    v6e-1 wrongly and a v5e-8 or v6e-8 into two hosts. Chips with two TensorCores (v4, v5p) run
    as one megacore device each, as torch_xla sees them (libtpu's default config would list
    every TensorCore as a device)."""
    kwargs = {"platform": "tpu", "topology_name": hw.topology}
    if hw.cores_per_chip > 1:
        kwargs["chip_config_name"] = "megacore"
    if hw.hosts == 1:
        dims = [int(d) for d in hw.topology.split(":")[1].split("x")]
        kwargs["chips_per_host_bounds"] = tuple((dims + [1, 1])[:3])
    return kwargs


def kernel_requests(hw, gpt, device_batch: int) -> list[dict]:
    """One compile request per distinct Pallas kernel the model's layers use on this hardware."""
    dims = [device_batch, gpt.n_head, gpt.sequence_len, gpt.head_dim]
    kinds = {(kernel, w) for w in gpt.windows if (kernel := tpu_kernel(gpt.attention, w))}
    return [{"topology": topology_kwargs(hw), "libtpu_init_args": libtpu_init_args(hw),
             "kernel": k, "window": w, "shape": dims} for k, w in sorted(kinds, key=str)]


def check_can_compile(hw, gpt) -> None:
    """Refuse early, before any tracing, what cannot be preflighted here."""
    if not hw.accelerator_type or hw.engine != "xla":
        raise ConfigError(f"mode=compile compiles for a TPU: hardware={hw.name} is not a TPU "
                          "profile (try hardware=v6e4)")
    needed = ["jax", "jaxlib", "libtpu"]
    if any(tpu_kernel(gpt.attention, w) == "splash" for w in gpt.windows):
        needed.append("flax")  # splash goes through call_jax -> torch_xla's torchax -> flax
    versions = stack_versions()
    missing = [p for p in needed if versions[p] is None]
    if missing:
        raise ConfigError(f"mode=compile needs {', '.join(missing)} (pip install 'xtrain[tpu]')")


def trace_environment(hw) -> dict[str, str]:
    """The trace child's environment: XLA on CPU with one virtual device per chip, JAX on CPU,
    the profile's other settings (they shape the graph), and nothing that would wake libtpu."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TPU_")}
    env.update({k: str(v) for k, v in hw.env.items()})
    env.update(PJRT_DEVICE="CPU", CPU_NUM_DEVICES=str(hw.chips), JAX_PLATFORMS="cpu")
    return env
