"""Checkpoints through fsspec (local paths or gs://), committed atomically, found on restart.

Layout: ``<dir>/step_000100/{tensors/, state.pt, meta.json, COMMITTED}``. ``tensors/`` is a
torch.distributed.checkpoint (DCP) directory holding every tensor of the checkpoint (model,
optimizer state); ``state.pt`` holds the rest (loop counters, loader position, ...) with each
tensor replaced by a reference into ``tensors/``. Under the XLA engine each host writes only its
own shards (torch_xla's SPMD planners) and loads only what its devices hold; the CPU engine
writes the same layout from one process. ``COMMITTED`` is written last, after every other byte is
durable: a checkpoint without it is incomplete (a crash mid-save) and is never chosen for resume.
Object stores have no atomic directory rename, so the marker (as Orbax's ``commit_success.txt``)
is the commit on every filesystem. Loading is a trust boundary: ``torch.load(weights_only=True)``,
DCP tensor data and JSON metadata, never pickle.

Lightning's own ``TorchCheckpointIO``/``XLACheckpointIO`` write with a plain ``torch.save`` to a
local path (neither atomic, sharded nor fsspec), hence this CheckpointIO.
"""

from __future__ import annotations

import io
import json
import os
import re
import signal
import socket
import sys
import tempfile
import time
import warnings
from concurrent.futures import ThreadPoolExecutor

import fsspec
import lightning as L
import torch
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
from lightning.pytorch.utilities.exceptions import SIGTERMException
from torch.distributed.checkpoint.api import CheckpointException

COMMIT_MARKER = "COMMITTED"
# Single-process saves and loads pass no_dist=True on purpose; DCP still warns about it each time.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
# DCP's file writer checks storage sizes through the deprecated TypedStorage (torch 2.9).
warnings.filterwarnings("ignore", message="TypedStorage is deprecated",
                        module="torch.distributed.checkpoint.filesystem")
_STEP_DIR = re.compile(r"step_(\d+)$")


def _fs(path: str):
    return fsspec.core.url_to_fs(path)


def step_dir(directory: str, step: int) -> str:
    return f"{directory.rstrip('/')}/step_{step:06d}"


def step_dirs(directory: str) -> list[tuple[int, str, bool]]:
    """(step, path, committed) of every step directory under ``directory``, oldest first."""
    fs, root = _fs(directory)
    fs.invalidate_cache()  # gcsfs caches listings: a stale one would hide the newest checkpoint
    if not fs.exists(root):
        return []
    found = []
    for entry in fs.ls(root, detail=False):
        m = _STEP_DIR.search(entry.rstrip("/"))
        if m:
            committed = fs.exists(f"{entry.rstrip('/')}/{COMMIT_MARKER}")
            found.append((int(m.group(1)), f"{directory.rstrip('/')}/{m.group(0)}", committed))
    return sorted(found)


def check_writable(directory: str) -> None:
    """Fail before training (and a TPU compile) when checkpoints cannot be written to
    ``directory``: a missing bucket, no permission, a file in the way."""
    from xtrain.config import ConfigError

    fs, root = _fs(directory)
    probe = f"{root.rstrip('/')}/.write-probe-{socket.gethostname()}-{os.getpid()}"
    try:
        fs.makedirs(root, exist_ok=True)
        fs.pipe_file(probe, b"")
        fs.rm(probe)
    except Exception as e:  # noqa: BLE001  (each filesystem raises its own types)
        raise ConfigError(f"checkpoint.dir {directory} is not writable ({type(e).__name__}: {e})") from e


def committed_checkpoints(directory: str) -> list[tuple[int, str]]:
    """(step, path) of complete checkpoints under ``directory``, oldest first."""
    return [(step, path) for step, path, committed in step_dirs(directory) if committed]


def latest_checkpoint(directory: str) -> str | None:
    found = committed_checkpoints(directory)
    return found[-1][1] if found else None


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


class FsspecCheckpointIO(CheckpointIO):
    """Lightning CheckpointIO: ``path`` is a checkpoint directory (see the module docstring).

    Saves are asynchronous: ``save_checkpoint`` snapshots the tensors to host memory on the
    caller's thread (training may change the weights right after): a copy of every tensor, or
    under ``sharded`` (XLA SPMD) of this host's shards only. A background thread then writes
    them, retrying with backoff when storage fails, and commits. At most one save is in flight,
    so the extra host memory is bounded by one snapshot (this host's share of the weights and
    optimizer state). ``wait()`` blocks until the save committed (the final and the preemption
    saves use it).

    ``sharded``: every host calls ``save_checkpoint`` and writes its own shards; the first host
    (``rank`` 0) also writes ``state.pt``, ``meta.json`` and, once DCP reports every host done,
    the commit marker. ``process_group`` spans the hosts (None on one host).
    """

    def __init__(self, retries: int = 5, backoff_s: float = 1.0, sharded: bool = False,
                 rank: int = 0, process_group=None):
        self.retries, self.backoff_s = retries, backoff_s
        self.sharded, self.rank, self.process_group = sharded, rank, process_group
        self.on_commit = None  # called from the upload thread with {"path", "ckpt_s", ...}
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="xtrain-ckpt")
        self._inflight = None

    def save_checkpoint(self, checkpoint, path, storage_options=None):
        self.wait()
        t0 = time.perf_counter()
        skeleton, tensors = split_tensors(checkpoint)
        snapshot = self._snapshot(tensors)
        rest = io.BytesIO()
        torch.save(skeleton, rest)
        meta = {"step": checkpoint.get("global_step"), "saved_at": time.time(),
                **checkpoint.get("xtrain_meta", {})}
        blocking = time.perf_counter() - t0
        self._inflight = self._pool.submit(self._upload, str(path), snapshot, rest.getvalue(), meta,
                                           t0, blocking)

    def _snapshot(self, tensors: dict) -> dict:
        if self.sharded:
            # torch_xla's helper (the one its CheckpointManager uses): this host's shards to CPU in
            # one transfer, kept with their indices for the SPMD save planner
            from torch_xla.experimental.distributed_checkpoint._helpers import _sharded_cpu_state_dict

            return _sharded_cpu_state_dict(tensors)
        return {k: t.detach().to("cpu", copy=True) for k, t in tensors.items()}

    def _planner(self, kind: str):
        if not self.sharded:
            return None  # DCP's defaults
        from torch_xla.experimental.distributed_checkpoint import SPMDLoadPlanner, SPMDSavePlanner

        return SPMDSavePlanner() if kind == "save" else SPMDLoadPlanner()

    def _dcp_kwargs(self) -> dict:
        return {"process_group": self.process_group, "no_dist": self.process_group is None}

    def _upload(self, path: str, snapshot: dict, rest: bytes, meta: dict, t0: float, blocking: float):
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

        delay = self.backoff_s
        for attempt in range(self.retries + 1):
            try:
                fs, root = _fs(path)
                if self.rank == 0:
                    if fs.exists(root):  # a torn attempt at this step; never a committed one we keep
                        fs.rm(root, recursive=True)
                    fs.makedirs(root, exist_ok=True)
                self._barrier()
                # the URL, not the bare root: DCP resolves its own filesystem from the protocol.
                # per_thread_copy_ahead=0: the snapshot is already in host memory, and DCP's
                # overlapping device-to-host loader breaks once torchax is imported (torch_xla's
                # mark_sharding imports it when flax is installed): torchax registers a "jax"
                # device module without current_stream(), which that loader calls.
                writer = FsspecWriter(f"{path.rstrip('/')}/tensors", per_thread_copy_ahead=0)
                dcp.save(snapshot, storage_writer=writer, planner=self._planner("save"),
                         **self._dcp_kwargs())
                if self.rank == 0:
                    fs.pipe_file(f"{root}/state.pt", rest)
                    _fault_injection_pause()
                    fs.pipe_file(f"{root}/meta.json", json.dumps(meta, indent=2).encode())
                    fs.pipe_file(f"{root}/{COMMIT_MARKER}", b"")
                break
            except (Exception, CheckpointException) as e:  # storage errors come in many types;
                # DCP wraps them in CheckpointException, a BaseException
                if attempt == self.retries:
                    _warn(f"giving up on checkpoint {path} after {attempt + 1} attempts ({e}); the "
                          "previous checkpoint stays the newest")
                    return None
                _warn(f"checkpoint upload to {path} failed ({type(e).__name__}: {e}); retrying in "
                      f"{delay:.0f} s ({attempt + 1}/{self.retries})")
                time.sleep(delay)
                delay *= 2
        result = {"path": path, "step": meta["step"], "ckpt_s": round(time.perf_counter() - t0, 3),
                  "ckpt_blocking_s": round(blocking, 3)}
        if self.on_commit and self.rank == 0:
            self.on_commit(result)
        return result

    def _barrier(self) -> None:
        if self.process_group is not None:
            import torch.distributed as dist

            dist.barrier(group=self.process_group)

    def wait(self):
        """Block until the in-flight upload (if any) has committed or given up."""
        if self._inflight is not None:
            inflight, self._inflight = self._inflight, None
            return inflight.result()
        return None

    def teardown(self) -> None:
        self.wait()

    def load_checkpoint(self, path, map_location=None, weights_only=True, targets: dict | None = None):
        """The checkpoint dict. ``targets`` maps tensor keys (see :func:`split_tensors`) to tensors
        to load into in place, e.g. the sharded device tensors of the model and optimizer; every
        other tensor is read into new CPU tensors."""
        # weights_only is always True here, whatever the caller asks: a checkpoint is untrusted input.
        fs, root = _fs(str(path))
        if not fs.exists(f"{root}/{COMMIT_MARKER}"):
            raise FileNotFoundError(f"{path}: not a committed checkpoint (no {COMMIT_MARKER})")
        skeleton = torch.load(io.BytesIO(fs.cat_file(f"{root}/state.pt")), map_location="cpu",
                              weights_only=True)
        with tempfile.TemporaryDirectory(prefix="xtrain-ckpt-") as staging:
            tensors = self._load_tensors(fs, f"{root}/tensors", staging, targets)
        return join_tensors(skeleton, tensors)

    def _load_tensors(self, fs, directory: str, staging: str, targets: dict | None) -> dict:
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
        dcp.load(tensors, storage_reader=reader, planner=self._planner("load"), **self._dcp_kwargs())
        return tensors

    def remove_checkpoint(self, path):
        fs, root = _fs(str(path))
        fs.rm(root, recursive=True)


def _warn(message: str) -> None:
    print(f"xtrain: warning: {message}", file=sys.stderr, flush=True)


def _fault_injection_pause() -> None:
    """Tests kill the process in the middle of a save: XTRAIN_FAULT_SAVE_PAUSE=seconds holds the
    save between the state and the commit marker, and announces it on stderr."""
    pause = float(os.environ.get("XTRAIN_FAULT_SAVE_PAUSE", "0"))
    if pause:
        print("xtrain-fault: checkpoint state written, commit pending", file=sys.stderr, flush=True)
        time.sleep(pause)


def stale_checkpoints(steps: list[int], keep_last: int, keep_every: int) -> list[int]:
    """Steps to delete: all but the newest ``keep_last`` and multiples of ``keep_every``."""
    keep = set(steps[-keep_last:]) if keep_last > 0 else set()
    if keep_every:
        keep |= {s for s in steps if s % keep_every == 0}
    return [s for s in steps if s not in keep]


class StopRequest:
    """SIGINT/SIGTERM handler that only raises a flag: the run stops at the next step boundary,
    after a checkpoint, never in the middle of an update.

    It replaces Lightning's SIGTERM handling for the whole fit (``install`` again once training
    has started, where Lightning has put its own handler in): Lightning checks its flag after
    the step's callbacks and would stop a step later without a checkpoint, or on pods at a step
    of rank 0's choosing while the other hosts are saving.
    """

    def __init__(self):
        self.signal = None
        self._previous = {}

    def install(self) -> None:
        """Handle SIGINT/SIGTERM from now on; ``uninstall`` restores the first call's handlers."""
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous = signal.signal(sig, self._handle)
            self._previous.setdefault(sig, previous)

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def _handle(self, signum, frame):
        self.signal = signum

    def agreed(self, process_group=None) -> bool:
        """Whether to stop now: on several hosts, True on all of them as soon as one host was
        signalled (preemption notices reach hosts at different steps; a save is collective)."""
        requested = self.signal is not None
        if process_group is None:
            return requested
        import torch.distributed as dist

        flag = torch.tensor([int(requested)])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=process_group)
        return bool(flag.item())


class PeriodicCheckpoint(L.Callback):
    """Saves every ``every`` steps (asynchronously), at the end and when a stop (preemption) is
    requested (both waiting for the commit); after each commit prunes by retention and removes
    torn attempts older than it, and reports the save's seconds."""

    def __init__(self, directory: str, every: int, checkpoint_io: FsspecCheckpointIO,
                 keep_last: int = 2, keep_every: int = 0, meta: dict | None = None,
                 stop: StopRequest | None = None, report=None):
        self.directory, self.every, self.io = directory.rstrip("/"), every, checkpoint_io
        self.keep_last, self.keep_every = max(1, keep_last), keep_every
        self.meta, self.stop, self.report = meta or {}, stop, report
        self.last_saved_step = None
        self.preempted = False
        self.preemption_saved = False  # the stop's checkpoint committed (False: upload gave up)
        checkpoint_io.on_commit = self._committed

    def save(self, trainer, wait: bool = False) -> bool:
        """Save this step (once); with ``wait``, True when it committed."""
        if trainer.global_step != self.last_saved_step:
            trainer.save_checkpoint(step_dir(self.directory, trainer.global_step))
            self.last_saved_step = trainer.global_step
        return wait and self.io.wait() is not None  # None: the upload gave up (it warned)

    def _committed(self, result: dict) -> None:
        """Upload thread: the checkpoint at ``result['step']`` is committed."""
        dirs = step_dirs(self.directory)
        committed = [s for s, _, done in dirs if done]
        doomed = set(stale_checkpoints(committed, self.keep_last, self.keep_every))
        for step, path, done in dirs:
            if step in doomed or (not done and step < result["step"]):
                self.io.remove_checkpoint(path)
        if self.report:
            self.report({k: v for k, v in result.items() if k != "path"})

    def on_save_checkpoint(self, trainer, pl_module, checkpoint):
        checkpoint["xtrain_meta"] = self.meta

    def on_train_start(self, trainer, pl_module):
        if self.stop is not None:
            self.stop.install()  # take SIGTERM back from Lightning (see StopRequest)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.stop is not None and self.stop.agreed(self.io.process_group):
            self.preemption_saved = self.save(trainer, wait=True)  # committed before exit
            self.preempted = True
            # Lightning's stop-by-signal exception, raised now: with only should_stop set it would
            # still run validation, which a 30 s preemption notice has no time for
            raise SIGTERMException
        elif self.every and trainer.global_step % self.every == 0:
            self.save(trainer)

    def on_train_end(self, trainer, pl_module):
        self.save(trainer, wait=True)


def check_compatible(path: str, shape: dict) -> None:
    """Refuse a checkpoint whose model differs in shape from the configured one."""
    from xtrain.config import ConfigError
    from xtrain.plan import model_shape

    fs, root = _fs(path)
    with fs.open(f"{root}/meta.json", "r") as f:
        saved_cfg = json.load(f).get("config", {})
    from omegaconf import OmegaConf

    saved = model_shape(OmegaConf.create(saved_cfg["model"]))
    keys = ("n_layer", "n_head", "n_kv_head", "n_embd", "vocab_size")
    diff = [f"{k} {saved[k]} -> {shape[k]}" for k in keys if saved[k] != shape[k]]
    if diff:
        raise ConfigError(f"checkpoint {path} holds a different model ({', '.join(diff)}); "
                          "start a new run (run.name=...) or restore the model config")
