"""The ``parallelism`` group: mesh axes over all devices and parameter sharding rules, as data.

Torch-free (the planner uses it); :mod:`xtrain.xla.spmd` applies the same rules to a model.
Like torchtitan's ``ParallelDims``, the degrees are checked against the device count and a -1
axis takes the remaining devices.
"""

from __future__ import annotations

import math
import re

from xtrain.config import BATCH_AXES, MESH_AXES
from xtrain.errors import ConfigError


def mesh_shape(par, devices: int) -> dict[str, int]:
    sizes = {axis: int(par[axis]) for axis in MESH_AXES}
    free = [a for a, n in sizes.items() if n == -1]
    if len(free) > 1 or any(n == 0 or n < -1 for n in sizes.values()):
        raise ConfigError(f"parallelism={par.name}: axis sizes {sizes}: use positive sizes and at "
                          "most one -1 (\"the remaining devices\")")
    fixed = math.prod(n for n in sizes.values() if n != -1)
    if free:
        if devices % fixed:
            raise ConfigError(f"parallelism={par.name}: {devices} devices do not divide by the fixed "
                              f"axes {' x '.join(f'{a}={n}' for a, n in sizes.items() if n != -1)} = {fixed}")
        sizes[free[0]] = devices // fixed
    if math.prod(sizes.values()) != devices:
        raise ConfigError(f"parallelism={par.name}: mesh {' x '.join(f'{a}={n}' for a, n in sizes.items())}"
                          f" = {math.prod(sizes.values())} devices, but the hardware has {devices}")
    return sizes


def batch_parallel(mesh: dict[str, int]) -> int:
    return math.prod(mesh[a] for a in BATCH_AXES)


def per_host_batch(mesh: dict[str, int]) -> bool:
    """Whether each host can feed only its own rows: the batch must be split over every device
    (torch_xla's per-host input sharding, xtrain/xla/spmd.py), i.e. not replicated over a tensor
    axis. Otherwise every host feeds the global batch and uploads only what its devices hold."""
    return batch_parallel(mesh) == math.prod(mesh.values())


def spec_for(name: str, rules) -> tuple | None:
    """The partition spec of the first rule whose pattern is found in ``name`` (None: replicated)."""
    for pattern, spec in rules:
        if re.search(pattern, name):
            return tuple(tuple(s) if isinstance(s, (list, tuple)) else s for s in spec)
    return None


def _axes_of(entry) -> tuple[str, ...]:
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, tuple) else (entry,)


def check_rules(rules, mesh: dict[str, int], params: dict[str, tuple[int, ...]]) -> dict[str, tuple | None]:
    """Validate every rule against the mesh and every parameter; returns name -> spec."""
    for pattern, spec in rules:
        try:
            re.compile(pattern)
        except re.error as e:
            raise ConfigError(f"parallelism rule {pattern!r}: bad regex ({e})") from e
        for entry in spec:
            for axis in _axes_of(tuple(entry) if isinstance(entry, list) else entry):
                if axis not in mesh:
                    raise ConfigError(f"parallelism rule {pattern!r} uses mesh axis {axis!r}, "
                                      f"which the mesh lacks (axes: {', '.join(mesh)})")
    specs = {}
    for name, shape in params.items():
        spec = spec_for(name, rules)
        if spec is not None:
            if len(spec) != len(shape):
                raise ConfigError(f"parallelism rule for {name}: spec {spec} has {len(spec)} entries, "
                                  f"the parameter has {len(shape)} dims {shape}")
            for dim, (size, entry) in enumerate(zip(shape, spec)):
                ways = math.prod(mesh[a] for a in _axes_of(entry))
                if size % ways:
                    raise ConfigError(f"parallelism rule for {name}: dim {dim} ({size}) does not "
                                      f"divide over {entry} ({ways} ways)")
        specs[name] = spec
    return specs


def shard_ways(spec, mesh: dict[str, int]) -> int:
    """Into how many pieces a parameter with ``spec`` is split (1: replicated)."""
    if spec is None:
        return 1
    return math.prod(math.prod(mesh[a] for a in _axes_of(e)) for e in spec)
