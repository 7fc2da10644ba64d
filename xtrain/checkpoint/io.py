"""One checkpoint written or read: tensors through torch.distributed.checkpoint (DCP), the rest
through ``state.pt`` with references, ``meta.json``, and the commit marker last.

``sharded`` (the XLA engine): every host snapshots and writes only its own shards, and reads
only what its devices hold (torch_xla's SPMD planners); ``process_group`` spans the hosts (None
on one host). The first host (``rank`` 0) writes ``state.pt``, ``meta.json`` and, once DCP
reports every host done, the marker.
"""

from __future__ import annotations

import io
import json
import os
import sys
import tempfile
import time
import warnings

import torch

from xtrain import compat
from xtrain.checkpoint.layout import COMMIT_MARKER
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


def _barrier(process_group) -> None:
    if process_group is not None:
        import torch.distributed as dist

        dist.barrier(group=process_group)


def write(path: str, tensors: dict, rest: bytes, meta: dict, *, sharded: bool = False,
          rank: int = 0, process_group=None) -> None:
    """Write one checkpoint and commit it (raises on any storage error; nothing is committed
    then). ``tensors`` is a :func:`snapshot`, ``rest`` the serialised skeleton."""
    import torch.distributed.checkpoint as dcp

    fs, root = url_to_fs(path)
    if rank == 0:
        if fs.exists(root):  # a torn attempt at this step; never a committed one we keep
            fs.rm(root, recursive=True)
        fs.makedirs(root, exist_ok=True)
    _barrier(process_group)
    # the URL, not the bare root: DCP resolves its own filesystem from the protocol
    dcp.save(tensors, storage_writer=compat.fsspec_writer(f"{path.rstrip('/')}/tensors"),
             planner=_planner(sharded, "save"), **_dcp_kwargs(process_group))
    if rank == 0:
        fs.pipe_file(f"{root}/state.pt", rest)
        _fault_injection_pause()
        fs.pipe_file(f"{root}/meta.json", json.dumps(meta, indent=2).encode())
        fs.pipe_file(f"{root}/{COMMIT_MARKER}", b"")


def read(path: str, targets: dict | None = None, *, sharded: bool = False, process_group=None):
    """The checkpoint dict. ``targets`` maps tensor keys (see :func:`split_tensors`) to tensors to
    load into in place, e.g. the sharded device tensors of the model and optimizer; every other
    tensor is read into new CPU tensors."""
    fs, root = url_to_fs(str(path))
    if not fs.exists(f"{root}/{COMMIT_MARKER}"):
        raise FileNotFoundError(f"{path}: not a committed checkpoint (no {COMMIT_MARKER})")
    skeleton = torch.load(io.BytesIO(fs.cat_file(f"{root}/state.pt")), map_location="cpu",
                          weights_only=True)  # a checkpoint is untrusted input
    with tempfile.TemporaryDirectory(prefix="xtrain-ckpt-") as staging:
        tensors = _read_tensors(fs, f"{root}/tensors", staging, targets, sharded, process_group)
    return join_tensors(skeleton, tensors)


def _read_tensors(fs, directory: str, staging: str, targets, sharded: bool, process_group) -> dict:
    import torch.distributed.checkpoint as dcp
    from fsspec.implementations.local import LocalFileSystem

    if not isinstance(fs, LocalFileSystem):
        # DCP's FsspecReader reads through file objects, which hung on gcsfs's prefetching
        # reads here (fsspec 2026.9, gcsfs 2026.10, GCS emulator): copy whole files instead.
        # Each host copies every host's files; the planner then reads only its shards.
        for remote in fs.ls(directory, detail=False):
            fs.get_file(remote, os.path.join(staging, remote.rstrip("/").rsplit("/", 1)[-1]))
        directory = staging
    reader = dcp.FileSystemReader(directory)
    stored = reader.read_metadata().state_dict_metadata
    tensors = dict(targets or {})
    for key, info in stored.items():
        if key not in tensors:
            tensors[key] = torch.empty(tuple(info.size), dtype=info.properties.dtype)
    dcp.load(tensors, storage_reader=reader, planner=_planner(sharded, "load"),
             **_dcp_kwargs(process_group))
    return tensors


def warn(message: str) -> None:
    print(f"xtrain: warning: {message}", file=sys.stderr, flush=True)


def _fault_injection_pause() -> None:
    """Tests kill the process in the middle of a save: XTRAIN_FAULT_SAVE_PAUSE=seconds holds the
    save between the state and the commit marker, and announces it on stderr."""
    pause = float(os.environ.get("XTRAIN_FAULT_SAVE_PAUSE", "0"))
    if pause:
        print("xtrain-fault: checkpoint state written, commit pending", file=sys.stderr, flush=True)
        time.sleep(pause)
