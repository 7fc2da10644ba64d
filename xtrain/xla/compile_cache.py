"""torch_xla's persistent compilation cache: a relaunched or resumed run loads its compiled step
instead of compiling it again (30-60+ minutes for a large step on a TPU).

torch_xla keys each entry by the hash of the computation (its HLO, shardings and devices), so a
different step never loads another step's executable. What that hash does not cover is kept
apart by directory: entries live under ``<dir>/<key>/`` where the key hashes the compiler stack
(torch, torch_xla, libtpu, jax versions), the hardware (accelerator type, topology) and the
environment variables that change code generation (``XLA_*``, ``LIBTPU_INIT_ARGS``).

Known limit (torch_xla 2.9.0): entries are written and found, but torch_xla cannot load them
("Failed to deserialize executable: UNIMPLEMENTED"): its PJRT client calls
``DeserializeExecutable``, which neither the CPU client nor, per pytorch/xla#9094, the TPU
client implements (the TPU client loads with ``LoadSerializedExecutable``; the fix,
pytorch/xla#9759, is not released). The step is then compiled as without a cache, and the run
says so; a torch_xla that loads its entries needs nothing changed here. Until then a relaunch
compiles again (a few minutes for d16; ``model.scan=true`` shortens it, xtrain/xla/layers.py).

``compile_cache.dir`` may be a ``gs://`` URL, so the cache outlives the VM: the local copy
(``<cache root>/xla_compile_mirror/<key>``) is pulled from the bucket before the runtime starts
and new entries are pushed after the first training step, at the end of the run and when it
stops. Entries are written whole by torch_xla and never changed, so pushing a file once is
enough. The mirror is checked writable before training; a pull or push that fails later costs a
warning, never the run.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from xtrain.compat import installed_versions
from xtrain.errors import warn
from xtrain.hardware import compile_cache_enabled
from xtrain.paths import as_url, cache_root, is_local, url_to_fs

STACK = ("torch", "torch_xla", "libtpu", "jax", "jaxlib")
# variables torch_xla's hash does not see but that change what is compiled; the cache's own
# variables (XLA_PERSISTENT_CACHE_*) are not part of it
_CODEGEN_ENV = ("XLA_FLAGS", "LIBTPU_INIT_ARGS", "PJRT_DEVICE", "XLA_USE_BF16",
                "XLA_NO_SPECIAL_SCALARS", "CPU_NUM_DEVICES")


def cache_key(hw, env=None) -> str:
    env = os.environ if env is None else env
    facts = {"versions": installed_versions(STACK), "accelerator": hw.accelerator_type,
             "topology": hw.topology, "engine": hw.engine,
             "env": {k: env.get(k) for k in _CODEGEN_ENV}}
    return hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()[:16]


class CompileCache:
    """Where this run's entries live (``local``), and their mirror (``remote``), if any."""

    def __init__(self, url: str | None, key: str):
        url = url or str(cache_root() / "xla_compile")
        self.key = key
        if is_local(url):
            self.local, self.remote = Path(os.path.expanduser(url.removeprefix("file://"))) / key, None
        else:
            self.local = cache_root() / "xla_compile_mirror" / key
            self.remote = url.rstrip("/") + "/" + key
        self.local.mkdir(parents=True, exist_ok=True)

    def entries(self) -> list[str]:
        """Names of the complete entries in the local directory."""
        return sorted(p.name for p in self.local.iterdir() if p.is_file() and not p.name.startswith("."))

    def _mirror(self):
        """The mirror's filesystem and its entries (name -> path), listed afresh: gcsfs caches
        listings, and another host may have pushed since."""
        fs, root = url_to_fs(self.remote)
        fs.invalidate_cache(root)
        paths = fs.ls(root, detail=False) if fs.exists(root) else []
        return fs, {p.rstrip("/").rsplit("/", 1)[-1]: p for p in paths}

    def pull(self) -> int:
        """Copy the mirror's entries missing locally; returns how many were copied."""
        if self.remote is None:
            return 0
        fs, there = self._mirror()
        missing = set(there) - set(self.entries())
        for name in sorted(missing):
            tmp = self.local / f".{name}.part"  # torch_xla must never see half a file
            fs.get(as_url(fs, there[name]), str(tmp))
            os.replace(tmp, self.local / name)
        return len(missing)

    def push(self) -> int:
        """Upload the local entries the mirror lacks; returns how many were uploaded."""
        if self.remote is None:
            return 0
        fs, there = self._mirror()
        missing = [name for name in self.entries() if name not in there]
        for name in missing:
            fs.put_file(str(self.local / name), f"{self.remote}/{name}")
        return len(missing)


def start_cache(compile_cache, hw) -> CompileCache | None:
    """Pull the mirror and point torch_xla at the local directory; before the runtime compiles
    anything (torch_xla reads the setting once, when it creates its computation cache)."""
    if not compile_cache_enabled(compile_cache, hw):
        return None
    import torch_xla.runtime as xr

    cache = CompileCache(compile_cache.dir, cache_key(hw))
    try:
        pulled = cache.pull()
    except Exception as e:  # noqa: BLE001  (storage errors come in many types)
        pulled = 0  # a cache only saves time: the run compiles as without it
        warn(f"compile cache mirror {cache.remote} not read ({type(e).__name__}: {e})")
    xr.initialize_cache(str(cache.local), readonly=False)
    where = f"{cache.local}" + (f" (mirror {cache.remote}: {pulled} entries pulled)" if cache.remote else "")
    print(f"XLA compile cache: {where}, {len(cache.entries())} entries", flush=True)
    return cache


def cache_counters() -> dict[str, int]:
    """torch_xla's persistent-cache counters for this process: entries found and loaded (Hit),
    found but not loadable (DeserializeFailure), not found (Miss: compiled, then stored)."""
    import torch_xla.debug.metrics as met

    return {k: met.counter_value(f"PersistentCache{k}") or 0
            for k in ("Hit", "Miss", "DeserializeFailure")}


def describe_counters(c: dict[str, int]) -> str:
    text = f"{c['Hit']} graphs loaded, {c['Miss']} compiled and stored"
    if c["DeserializeFailure"]:
        text += (f", {c['DeserializeFailure']} found but not loadable by this torch_xla (compiled "
                 "again; pytorch/xla#9094)")
    return text
