"""Where checkpoints live and which ones count: step directories, the commit marker, discovery
of committed checkpoints, retention, setting a committed one aside instead of deleting it, the
file names a checkpoint may name (it is untrusted input), and the up-front check that a
directory is writable."""

from __future__ import annotations

import json
import os
import re
import time
import uuid

from xtrain.errors import CheckpointError, ConfigError
from xtrain.paths import as_url, is_local, is_local_fs, url_to_fs, write_refused

COMMIT_MARKER = "COMMITTED"
_STEP_DIR = re.compile(r"step_(\d+)")  # the whole name: a set-aside (step_000020.corrupt-...) or
# a copy kept by hand (backup_step_000020) is not a checkpoint of the run
# The data files DCP's file writer names (torch 2.9, torch/distributed/checkpoint/filesystem.py:
# f"{prefix}{n}{DEFAULT_SUFFIX}", prefix "__<rank>_", suffix ".distcp"): a plain name in tensors/.
DCP_DATA_FILE = re.compile(r"__\d+_\d+\.distcp")
GLOB_CHARACTERS = re.compile(r"[*?\[\]]")  # fsspec's and gcsfs's rm, copy and find expand them


def step_dir(directory: str, step: int) -> str:
    return f"{directory.rstrip('/')}/step_{step:06d}"


def step_of(path: str) -> int | None:
    """The step a step directory's name says; None when the name is not a step directory's."""
    m = _STEP_DIR.fullmatch(str(path).rstrip("/").rsplit("/", 1)[-1])
    return int(m.group(1)) if m else None


def step_dirs(directory: str) -> list[tuple[int, str, bool]]:
    """(step, path, committed) of every step directory under ``directory``, oldest first."""
    fs, root = url_to_fs(directory)
    fs.invalidate_cache()  # gcsfs caches listings: a stale one would hide the newest checkpoint
    if not fs.exists(root):
        return []
    found = []
    for entry in fs.ls(root, detail=False):
        step = step_of(entry)
        if step is not None:
            committed = fs.exists(f"{entry.rstrip('/')}/{COMMIT_MARKER}")
            name = entry.rstrip("/").rsplit("/", 1)[-1]
            found.append((step, f"{directory.rstrip('/')}/{name}", committed))
    return sorted(found)


def committed_checkpoints(directory: str) -> list[tuple[int, str]]:
    """(step, path) of complete checkpoints under ``directory``, oldest first."""
    return [(step, path) for step, path, committed in step_dirs(directory) if committed]


def latest_checkpoint(directory: str) -> str | None:
    found = committed_checkpoints(directory)
    return found[-1][1] if found else None


def commit(fs, root: str, written: list[str]) -> None:
    """Write the commit marker of the checkpoint at ``root`` once ``written`` (its files and
    dirs, relative) are durable, then make the marker durable, before retention deletes an older
    checkpoint. On a local disk a closed file may be only in the page cache, and a power loss
    could leave COMMITTED over empty files; an object store's finished write is durable."""
    local = is_local_fs(fs)
    if local:
        _fsync([f"{root}/{name}" for name in written] + [root])
    fs.pipe_file(f"{root}/{COMMIT_MARKER}", b"")
    if local:  # the marker, its entry, and the step dir's entry in the checkpoints dir
        _fsync([f"{root}/{COMMIT_MARKER}", root, os.path.dirname(root.rstrip("/"))])


def _fsync(paths: list[str]) -> None:
    for path in paths:
        fd = os.open(path, os.O_RDONLY)  # (a directory too: its entries)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def check_committed(fs, root: str, path: str) -> None:
    if not fs.exists(f"{root}/{COMMIT_MARKER}"):
        raise FileNotFoundError(f"{path}: not a committed checkpoint (no {COMMIT_MARKER})")


def is_committed(path: str) -> bool:
    fs, root = url_to_fs(path)
    fs.invalidate_cache(root)  # gcsfs caches listings: a stale one would miss a marker written since
    return fs.exists(f"{root}/{COMMIT_MARKER}")


def surely_uncommitted(path: str) -> bool:
    """Whether the storage says the step dir at ``path`` has no commit marker (FileNotFoundError).
    fsspec's ``exists`` is False on any error too (a transient EIO, a stale NFS handle): a commit
    it misses must not be deleted as a torn save."""
    fs, root = url_to_fs(path)
    try:
        fs.info(f"{root}/{COMMIT_MARKER}")
    except FileNotFoundError:
        return True
    except Exception:  # noqa: BLE001  (each filesystem raises its own types: no answer)
        return False
    return False


def newer_commits(directory: str, step: int) -> list[str]:
    """The committed checkpoints in ``directory`` past ``step``."""
    return [p for s, p in committed_checkpoints(directory) if s > step]


def lacks(record, fields: dict[str, type]) -> str | None:
    """What ``record`` (a checkpoint's file, untrusted) lacks of the ``fields`` (name -> type)
    every one xtrain writes holds; None: nothing."""
    if not isinstance(record, dict):
        return f"a {type(record).__name__}, not a dict"
    wrong = [name for name, kind in fields.items()
             if not isinstance(record.get(name), kind) or isinstance(record.get(name), bool)]
    return f"no {', '.join(repr(n) for n in wrong)} of the type xtrain writes" if wrong else None


def read_meta(path: str) -> dict:
    """A checkpoint's meta.json (the run's resolved config, versions, step); ValueError: not one
    xtrain wrote (its step read by every resume)."""
    fs, root = url_to_fs(str(path))
    with fs.open(f"{root}/meta.json", "r") as f:
        meta = json.load(f)
    if why := lacks(meta, {"step": int}):
        raise ValueError(f"meta.json holds {why}")
    return meta


def run_of(meta: dict, path: str) -> str | None:
    """The run that wrote a checkpoint, as its ``meta`` (:func:`read_meta`) says; None: unnamed."""
    try:
        return (meta.get("config") or {}).get("run", {}).get("name")
    except (TypeError, ValueError, AttributeError) as e:
        raise CheckpointError(f"{path}: unreadable meta.json ({type(e).__name__}: {e})") from e


def saved_config(meta: dict, path: str):
    """The config a checkpoint's ``meta`` (:func:`read_meta`) holds, as an OmegaConf object whose
    strings are only text: xtrain writes the config resolved, so a ``${...}`` there is a value
    (one a config escaped) or a crafted file's, and is never resolved (``${oc.env:...}`` would
    read a secret into a path or an error message)."""
    from omegaconf import OmegaConf

    config = meta.get("config") if isinstance(meta, dict) else None
    if not isinstance(config, dict):
        raise CheckpointError(f"{path}: meta.json holds no config")
    return OmegaConf.create(_escaped(config))


def _escaped(value):
    """A JSON value with every ``${`` escaped, as OmegaConf reads a literal one (backslashes before
    it doubled: OmegaConf reads ``\\\\`` there as one)."""
    if isinstance(value, str):
        return re.sub(r"(\\*)\$\{", lambda m: 2 * m[1] + "\\${", value)
    if isinstance(value, dict):
        return {k: _escaped(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_escaped(v) for v in value]
    return value


def stale_checkpoints(steps: list[int], keep_last: int, keep_every: int) -> list[int]:
    """Steps to delete: all but the newest ``keep_last`` and multiples of ``keep_every``."""
    keep = set(steps[-keep_last:]) if keep_last > 0 else set()
    if keep_every:
        keep |= {s for s in steps if s % keep_every == 0}
    return [s for s in steps if s not in keep]


def remove(path: str) -> None:
    """Delete a checkpoint directory, its commit marker first: a deletion cut short leaves an
    uncommitted directory, never a committed one with files missing."""
    fs, root = url_to_fs(path)
    if fs.exists(f"{root}/{COMMIT_MARKER}"):
        fs.rm(f"{root}/{COMMIT_MARKER}")
    fs.rm(root, recursive=True)


def check_dcp_files(checkpoint: str, names) -> None:
    """Refuse DCP metadata naming a data file DCP does not write: its ``relative_path`` is joined
    to the directory read from (and, on remote storage, to the local staging directory written
    to), so ``../../x`` or an absolute path would read or write outside the checkpoint."""
    for name in names:
        if not (isinstance(name, str) and DCP_DATA_FILE.fullmatch(name)):
            raise CheckpointError(
                f"checkpoint {checkpoint}: tensors/.metadata names the data file {_shown(name)}, "
                "not one DCP writes (__<rank>_<n>.distcp): refused before reading any (a "
                "checkpoint is untrusted input)")


def check_inside(checkpoint: str, names) -> None:
    """Refuse manifest entries that are not relative paths inside the checkpoint directory (an
    absolute path, ``..``, an empty part): verifying would read whatever they point at."""
    for name in names:
        parts = name.split("/") if isinstance(name, str) else [""]
        if any(p in ("", ".", "..") for p in parts) or "\\" in name or "\0" in name:
            raise CheckpointError(
                f"checkpoint {checkpoint}: manifest.json lists {_shown(name)}, not a path inside "
                "the checkpoint: refused before reading any (a checkpoint is untrusted input)")


def _shown(value) -> str:
    text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."


def set_aside(path: str, reason: str) -> str:
    """Move a checkpoint directory out of discovery's sight, kept whole for inspection:
    ``step_000020`` becomes ``step_000020.<reason>-<UTC time>``; returns the new path. A rename on
    a local disk; elsewhere (object stores have none) a server-side copy, then :func:`remove`."""
    fs, root = url_to_fs(path)
    stamp, n = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()), 1
    aside = f"{root.rstrip('/')}.{reason}-{stamp}"
    while fs.exists(aside):
        n += 1
        aside = f"{root.rstrip('/')}.{reason}-{stamp}-{n}"
    if is_local(path):
        fs.mv(root, aside, recursive=True)
    else:
        fs.copy(root, aside, recursive=True)
        fs.invalidate_cache()
        if _sizes(fs, aside) != _sizes(fs, root):  # fsspec's copy skips what it cannot find
            raise CheckpointError(f"checkpoint {path}: its copy to {aside} is incomplete; the "
                                  "original is kept (remove the copy)")
        remove(path)
    fs.invalidate_cache()
    return aside if is_local(path) else as_url(fs, aside)


def _sizes(fs, root: str) -> dict[str, int]:
    return {p[len(root):]: info["size"] for p, info in fs.find(root, detail=True).items()}


def check_writable(directory: str, key: str = "checkpoint.dir") -> None:
    """Fail before training (and a TPU compile) when files cannot be written to ``directory``
    (the config's ``key``): a missing bucket, no permission, a file in the way."""
    if GLOB_CHARACTERS.search(directory):
        raise ConfigError(f"{key} {directory} holds one of *?[]: fsspec reads paths "
                          "with them as patterns (a removal by retention could match others)")
    refused = write_refused(directory)
    if refused:
        raise ConfigError(f"{key} {directory} is not writable ({refused})")


def check_shared(directory: str, processes) -> None:
    """On several processes (``processes``: xtrain/engines/processes.py), refuse before training a
    checkpoint directory they do not all see: each writes its own files of every checkpoint
    there and process 0 commits them, so a local path on several hosts would leave every
    checkpoint incomplete."""
    if processes.world == 1:
        return
    fs, root = url_to_fs(directory)
    probe = f"{root.rstrip('/')}/.shared-probe-{processes.broadcast(uuid.uuid4().hex)}"
    if processes.primary:
        fs.makedirs(root, exist_ok=True)
        fs.pipe_file(probe, b"")
    processes.barrier()
    fs.invalidate_cache()
    unseen = processes.vote(not fs.exists(probe))()
    processes.barrier()  # every process has looked before the probe goes
    if processes.primary:
        fs.rm(probe)
    if unseen:
        raise ConfigError(f"checkpoint.dir {directory} is not shared by the run's {processes.world} "
                          "processes (some do not see process 0's files): use storage every host "
                          "reaches, e.g. gs://bucket/...")
