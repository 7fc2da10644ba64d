"""One checkpoint written or read: tensors through torch.distributed.checkpoint (DCP), the rest
through ``state.pt`` with references, ``meta.json``, every file's size and checksum in
``manifest.json``, and the commit marker last.

``sharded`` (the XLA engine): every host snapshots and writes only its own shards, and reads
only what its devices hold (torch_xla's SPMD planners); ``process_group`` spans the hosts (None
on one host). The first host (``rank`` 0) writes ``state.pt``, ``meta.json`` and, once DCP
reports every host done, the marker. On remote storage each host copies only the DCP files that
hold what it loads, plus DCP's metadata (:class:`StagingReader`).

A checkpoint is untrusted input: a file it cannot be loaded from safely (pickled code in
``state.pt`` or DCP's metadata, a data file named outside it) is refused with a
:class:`~xtrain.errors.CheckpointError` naming it, before anything of it is read or copied.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import sys
import tempfile
import time
import warnings
from contextlib import contextmanager

import torch
from torch.distributed.checkpoint import FileSystemReader

from xtrain import compat
from xtrain.checkpoint import manifest
from xtrain.checkpoint.collective import agree
from xtrain.checkpoint.layout import (check_committed, check_dcp_files, commit, is_committed, read_meta,
                                      remove, set_aside, surely_uncommitted)
from xtrain.errors import CheckpointError, unpickling_reason, warn
from xtrain.paths import url_to_fs

# Single-process saves and loads pass no_dist=True on purpose; DCP still warns about it each time.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
# DCP's file writer checks storage sizes through the deprecated TypedStorage (torch 2.9).
warnings.filterwarnings("ignore", message="TypedStorage is deprecated",
                        module="torch.distributed.checkpoint.filesystem")

TENSOR_REF = "xtrain-tensor:"  # a tensor's place in state.pt; its data is under tensors/


def split_tensors(obj, path: str = ""):
    """(skeleton, {key: tensor}): every tensor in nested dicts/lists/tuples replaced by a
    reference string naming its key."""
    tensors: dict = {}

    def walk(x, key):
        if isinstance(x, torch.Tensor):
            tensors[key] = x
            return TENSOR_REF + key
        if isinstance(x, dict):
            return {k: walk(v, f"{key}/{k}") for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return type(x)(walk(v, f"{key}/{i}") for i, v in enumerate(x))
        return x

    return walk(obj, path), tensors


def join_tensors(skeleton, tensors: dict):
    """Inverse of :func:`split_tensors`."""
    if isinstance(skeleton, str) and skeleton.startswith(TENSOR_REF):
        return tensors[skeleton[len(TENSOR_REF):]]
    if isinstance(skeleton, dict):
        return {k: join_tensors(v, tensors) for k, v in skeleton.items()}
    if isinstance(skeleton, (list, tuple)):
        return type(skeleton)(join_tensors(v, tensors) for v in skeleton)
    return skeleton


def snapshot(tensors: dict, sharded: bool) -> dict:
    """Host-memory copies of ``tensors`` (training may change them right after): all of each, or
    under ``sharded`` this host's shards only, in one device-to-host transfer."""
    if sharded:
        return compat.sharded_cpu_state_dict(tensors)
    return {k: t.detach().to("cpu", copy=True) for k, t in tensors.items()}


def _planner(sharded: bool, kind: str):
    if not sharded:
        return None  # DCP's defaults
    from torch_xla.experimental.distributed_checkpoint import SPMDLoadPlanner, SPMDSavePlanner

    return SPMDSavePlanner() if kind == "save" else SPMDLoadPlanner()


def _dcp_kwargs(process_group) -> dict:
    return {"process_group": process_group, "no_dist": process_group is None}


def write(path: str, tensors: dict, rest: bytes, meta: dict, *, sharded: bool = False,
          rank: int = 0, process_group=None, fence=None) -> None:
    """Write one checkpoint and commit it (raises on any storage error; nothing is committed
    then). ``tensors`` is a :func:`snapshot`, ``rest`` the serialised skeleton.

    Collective on several processes. A storage error on one of them is caught and shared at the
    next collective rather than raised between two (a process that skips a collective stalls
    the others until the timeout, which closes the checkpoint group's connections for good).
    ``fence``: called by the first host before anything is written and again before the commit
    marker; raises when the save must not happen or be committed (the directory's lease lost:
    xtrain/checkpoint/lease.py, LeaseLost, which is raised on every process). A retry that finds
    the step committed by an earlier attempt of the same save (:func:`committed_by`) keeps it."""
    import torch.distributed.checkpoint as dcp

    fs, root = url_to_fs(path)
    error, done = None, False
    if rank == 0:
        try:
            if fence is not None:
                fence()
            done = committed_by(path, meta)
            if not done:
                _prepare(path, fs, root)
        except Exception as e:  # noqa: BLE001  (each filesystem raises its own types)
            error = e
    if agree(error, process_group, done):
        return
    written: list[str] = []  # this host's DCP files
    # the URL, not the bare root: DCP resolves its own filesystem from the protocol
    dcp.save(tensors, storage_writer=compat.fsspec_writer(f"{path.rstrip('/')}/tensors", written),
             planner=_planner(sharded, "save"), **_dcp_kwargs(process_group))
    # every host records what it wrote; the first host writes the manifest (xtrain/checkpoint/manifest.py)
    try:
        mine = manifest.describe(fs, root, [f"tensors/{f}" for f in written])
    except Exception as e:  # noqa: BLE001
        mine, error = None, e
    entries = manifest.gather(mine, process_group)  # None: some host could not describe its files
    committed = False
    if rank == 0 and error is None:
        try:
            if entries is None:
                raise RuntimeError("another process could not list the files it wrote")
            if fence is not None:  # (taken over during a long write: left uncommitted)
                fence()
            _commit(fs, root, rest, meta, entries)
            committed = True
        except Exception as e:  # noqa: BLE001
            error = e
    try:
        agree(error, process_group)
    except Exception as e:  # noqa: BLE001
        if not committed:
            raise
        # every host's files were written and described (the gather said so): the commit stands,
        # whatever became of the other processes since (the engine names a lost one)
        warn(f"checkpoint {path} committed, but the processes could not confirm it together "
             f"({type(e).__name__}: {e})")


def committed_by(path: str, meta: dict) -> bool:
    """Whether the checkpoint at ``path`` is committed, intact, by the save of ``meta``: an
    earlier attempt of a retried save that committed and then failed (a storage call that timed
    out after its object was stored). Writing it anew would first move that commit aside."""
    if "saved_at" not in meta or not is_committed(path):
        return False
    try:
        return read_meta(path).get("saved_at") == meta["saved_at"] and not manifest.problems(path)
    except (OSError, ValueError, AttributeError):  # (an unreadable meta.json: not this save's)
        return False


def _prepare(path: str, fs, root: str) -> None:
    """The first host's start of a save: the step's directory, empty."""
    if is_committed(path):  # never deleted: a commit is kept, moved aside (and said so)
        warn(f"checkpoint {path} was already committed: moved aside to "
             f"{set_aside(path, 'replaced')} (kept, not deleted); writing this step anew")
    elif fs.exists(root):  # a torn attempt at this step (never committed)
        if not surely_uncommitted(path):  # (the marker's check failed: maybe a commit)
            raise OSError(f"{path}: could not tell whether it holds a commit")
        remove(path)
    fs.makedirs(root, exist_ok=True)


def _commit(fs, root: str, rest: bytes, meta: dict, entries: dict) -> None:
    """The first host's end of a save, once every host's tensors are written: the skeleton, the
    metadata, the manifest, then the commit marker, once they are durable."""
    fs.pipe_file(f"{root}/state.pt", rest)
    _fault_injection_pause()
    fs.pipe_file(f"{root}/meta.json", json.dumps(meta, indent=2).encode())
    own = ["tensors/.metadata", "state.pt", "meta.json"]  # .metadata: DCP's, by this host
    manifest.write(fs, root, {**entries, **manifest.describe(fs, root, own)})
    commit(fs, root, [*own, manifest.MANIFEST, "tensors"])


def read(path: str, targets: dict | None = None, *, sharded: bool = False, process_group=None):
    """The checkpoint dict. ``targets`` maps tensor keys (see :func:`split_tensors`) to tensors to
    load into in place, e.g. the sharded device tensors of the model and optimizer; every other
    tensor is read into new CPU tensors."""
    fs, root = url_to_fs(str(path))
    check_committed(fs, root, path)
    skeleton = read_plain_state(path)
    with tempfile.TemporaryDirectory(prefix="xtrain-ckpt-") as staging:
        tensors = _read_tensors(fs, path, staging, targets, sharded, process_group,
                                referenced=_references(skeleton))
    return join_tensors(skeleton, tensors)


def check_loadable(path: str) -> None:
    """Refuse (CheckpointError) a checkpoint that :func:`read` would refuse for what its
    ``state.pt`` or DCP metadata holds, reading only those two small files: run before a model
    is built or data prepared, so a crafted checkpoint is turned away in seconds."""
    _check_complete(path, missing_tensors(path))


def missing_tensors(path: str) -> list[str]:
    """The tensors the checkpoint's ``state.pt`` refers to that its tensors/ lacks (empty: none),
    from those two small files; refused (CheckpointError) where :func:`read` would refuse them."""
    fs, root = url_to_fs(str(path))
    skeleton = read_plain_state(path)
    with tempfile.TemporaryDirectory(prefix="xtrain-ckpt-") as staging, _refusals(path):
        stored = _reader(fs, path, staging).read_metadata().state_dict_metadata
    return sorted(_references(skeleton) - set(stored))


def _references(skeleton) -> set[str]:
    """The tensor keys a :func:`split_tensors` skeleton refers to."""
    if isinstance(skeleton, str) and skeleton.startswith(TENSOR_REF):
        return {skeleton[len(TENSOR_REF):]}
    if isinstance(skeleton, (dict, list, tuple)):
        values = skeleton.values() if isinstance(skeleton, dict) else skeleton
        return set().union(*(_references(v) for v in values))
    return set()


def lacking(missing: list[str]) -> str:
    """What :func:`missing_tensors` found, for a message: how many, and the first few."""
    return (f"{len(missing)} of the tensors its state.pt refers to ({', '.join(missing[:3])}"
            f"{', ...' if len(missing) > 3 else ''})")


def _check_complete(path: str, missing: list[str]) -> None:
    """Refuse a checkpoint whose tensors/ lacks a tensor its ``state.pt`` refers to (such a
    checkpoint committed: fsdp_tp on one 8-chip host, before xtrain/compat.py
    sharded_cpu_state_dict kept replicated shards)."""
    if missing:
        raise CheckpointError(f"checkpoint {path}: tensors/ lacks {lacking(missing)}: it was saved "
                              "incomplete and cannot be loaded")


def read_plain_state(path: str):
    """``state.pt`` alone (``weights_only=True``): plain data, its tensors only named; no code.
    (What it must hold is its reader's to check: a training's, xtrain/train/loader_state.py.)"""
    fs, root = url_to_fs(str(path))
    data = fs.cat_file(f"{root}/state.pt")
    try:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)  # untrusted input
    except Exception as e:  # noqa: BLE001  (a damaged pickle raises many types: IndexError, ...)
        raise CheckpointError(f"checkpoint {path}: state.pt refused ({unpickling_reason(e)}): only "
                              "plain data and tensors are loaded from a checkpoint") from e


@contextmanager
def _refusals(path: str):
    """Unpickling refusals (DCP's metadata, a tensor's pickle), raised directly or wrapped by DCP
    in a CheckpointException (a BaseException), as one CheckpointError naming ``path``; so is
    any other error DCP wraps (a data file that is no zip: its bytes damaged, or crafted), but
    storage's (an OSError: a bucket that failed, which is no fault of the checkpoint's)."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        yield
    except (pickle.UnpicklingError, EOFError, CheckpointError, CheckpointException) as e:
        wrapped = isinstance(e, CheckpointException)
        causes = [f[0] for f in e.failures.values()] if wrapped else [e]
        refused = next((c for c in causes if isinstance(c, CheckpointError)), None)
        if refused is not None and refused is not e:
            raise refused from e
        unpickling = next((c for c in causes if isinstance(c, (pickle.UnpicklingError, EOFError))), None)
        other = next((c for c in causes if wrapped and not isinstance(c, OSError)), None)
        if unpickling is None and other is None:
            raise
        reason = (unpickling_reason(unpickling) if unpickling is not None
                  else " ".join(f"{type(other).__name__}: {other}".split())[:300])
        raise CheckpointError(f"checkpoint {path}: tensors/ refused ({reason})") from e


class CheckedReader(compat.dcp_reader(FileSystemReader)):
    """DCP's file reader, its metadata unpickled with only DCP's own classes allowed
    (xtrain/compat.py, dcp_reader), and every data file that metadata names checked to be one
    DCP writes (xtrain/checkpoint/layout.py, check_dcp_files), on every read of it (DCP reads it
    again inside ``dcp.load``). ``checkpoint`` names the checkpoint in a refusal."""

    def __init__(self, path: str, checkpoint: str | None = None):
        super().__init__(path)
        self.checkpoint = checkpoint or str(path)

    def read_metadata(self, *args, **kwargs):
        metadata = super().read_metadata(*args, **kwargs)
        storage = metadata.storage_data
        check_dcp_files(self.checkpoint, [getattr(info, "relative_path", info) for info in
                                          storage.values()] if isinstance(storage, dict) else [storage])
        return metadata


class StagingReader(CheckedReader):
    """DCP's file reader over a local copy of a remote DCP directory, made on demand: DCP's
    metadata first, then only the files that hold what this process's load plan reads (on a pod,
    a host's own shards), never every host's files.

    Why copies: DCP's FsspecReader reads through file objects, which hung on gcsfs's prefetching
    reads here (fsspec 2026.9, gcsfs 2026.10, GCS emulator); whole-file copies do not.
    """

    def __init__(self, fs, remote_dir: str, staging: str, checkpoint: str | None = None):
        super().__init__(staging, checkpoint or remote_dir)
        self.remote_fs, self.remote_dir, self.staging = fs, remote_dir.rstrip("/"), staging
        self.copied: list[str] = []  # file names, in the order they were copied
        self._where: dict = {}

    def _copy(self, name: str) -> None:
        if name not in self.copied:
            self.remote_fs.get_file(f"{self.remote_dir}/{name}", os.path.join(self.staging, name))
            self.copied.append(name)

    def read_metadata(self, *args, **kwargs):
        rank = kwargs.get("rank")  # DCP's metadata file: .metadata, or __<rank>.metadata
        self._copy(".metadata" if rank is None else f"__{rank}.metadata")
        return super().read_metadata(*args, **kwargs)

    def set_up_storage_reader(self, metadata, is_coordinator: bool, *args, **kwargs) -> None:
        self._where = metadata.storage_data  # storage index -> (file, offset, length)
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)

    def read_data(self, plan, planner):
        # names checked as the metadata was read: plain file names, staged inside ``staging``
        for name in sorted({self._where[item.storage_index].relative_path for item in plan.items}):
            self._copy(name)
        return super().read_data(plan, planner)


def read_tensors(path: str, prefix: str) -> dict:
    """Only the stored tensors whose key starts with ``prefix`` (e.g. the model's weights without
    the optimizer state, for sampling), as new CPU tensors: {key: tensor}."""
    fs, root = url_to_fs(str(path))
    check_committed(fs, root, path)
    with tempfile.TemporaryDirectory(prefix="xtrain-ckpt-") as staging:
        return _read_tensors(fs, path, staging, None, False, None, prefix)


MODEL_PREFIX = "/state_dict/model."  # where the model's weights sit in a saved state


def read_model_weights(path: str) -> dict:
    """A committed checkpoint's model weights, without the optimizer state, as the model's
    state dict (new CPU tensors)."""
    return {k[len(MODEL_PREFIX):]: v for k, v in read_tensors(path, MODEL_PREFIX).items()}


def _reader(fs, path: str, staging: str) -> CheckedReader:
    """The reader of the checkpoint at ``path``'s tensors/: in place on a local disk, else
    through copies in ``staging``."""
    from fsspec.implementations.local import LocalFileSystem

    directory = f"{url_to_fs(str(path))[1]}/tensors"
    if isinstance(fs, LocalFileSystem):
        return CheckedReader(directory, str(path))
    return StagingReader(fs, directory, staging, str(path))


def _read_tensors(fs, path: str, staging: str, targets, sharded: bool, process_group,
                  prefix: str = "", referenced: set[str] = frozenset()) -> dict:
    import torch.distributed.checkpoint as dcp

    reader = _reader(fs, path, staging)
    with _refusals(path):
        stored = reader.read_metadata().state_dict_metadata
        _check_complete(path, sorted(referenced - set(stored)))
        tensors = dict(targets or {})
        for key, info in stored.items():
            if key not in tensors and key.startswith(prefix):
                tensors[key] = torch.empty(tuple(info.size), dtype=info.properties.dtype)
        dcp.load(tensors, storage_reader=reader, planner=_planner(sharded, "load"),
                 **_dcp_kwargs(process_group))
    return tensors


def _fault_injection_pause() -> None:
    """Tests kill the process (or cut its storage) in the middle of a save:
    XTRAIN_FAULT_SAVE_PAUSE=seconds holds the save between the state and the commit marker, and
    announces it on stderr."""
    pause = float(os.environ.get("XTRAIN_FAULT_SAVE_PAUSE", "0"))
    if pause:
        print("xtrain-fault: checkpoint state written, commit pending", file=sys.stderr, flush=True)
        time.sleep(pause)
