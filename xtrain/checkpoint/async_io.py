"""Lightning's CheckpointIO for xtrain's layout: a snapshot on the caller's thread, the upload in
the background with retries.

Lightning's own ``TorchCheckpointIO``/``XLACheckpointIO`` write with a plain ``torch.save`` to a
local path (neither atomic, sharded nor fsspec), hence this one.
"""

from __future__ import annotations

import io
import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor

import torch
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
from torch.distributed.checkpoint.api import CheckpointException

from xtrain.checkpoint import io as ckpt_io
from xtrain.checkpoint.collective import check_fence
from xtrain.checkpoint.layout import remove
from xtrain.checkpoint.lease import LeaseLost
from xtrain.paths import is_local, url_to_fs

MIB = 2**20


def _nbytes(obj) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.nbytes
    if isinstance(obj, dict):
        return sum(map(_nbytes, obj.values()))
    if isinstance(obj, (list, tuple)):
        return sum(map(_nbytes, obj))
    # a sharded snapshot's entry (torch_xla's _CpuShards): this host's shards
    return sum(_nbytes(shard.data) for shard in getattr(obj, "shards", ()))


def _disk_short(path: str, needed: int) -> str | None:
    """Said when the local disk under ``path`` has less room left than a checkpoint of ``needed``
    bytes (a full disk fails DCP's writes without saying so: torch's zip writer reports only an
    "unexpected pos"); None elsewhere."""
    if not is_local(path):
        return None
    place = url_to_fs(path)[1]
    while place and not os.path.isdir(place):
        place = os.path.dirname(place)
    free = shutil.disk_usage(place or "/").free
    if free >= needed:
        return None
    return (f"the disk holding it has {free / MIB:.0f} MiB free, this checkpoint needs about "
            f"{needed / MIB:.0f} MiB: retention removes old checkpoints only after a new one "
            "commits, so checkpoint.dir needs room for checkpoint.keep_last + 1 of them")


def failure(error: BaseException, path: str, needed: int) -> str:
    """A failed write in one line: each process's error of DCP's CheckpointException (whose own
    text holds their tracebacks), and a local disk too full for the checkpoint."""
    def line(e):
        return f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"

    if isinstance(error, CheckpointException):
        said = "; ".join(f"rank {rank}: {line(e)}" for rank, (e, _) in error.failures.items())
    else:
        said = line(error)
    short = _disk_short(path, needed)
    return said + (f"; {short}" if short else "")


class FsspecCheckpointIO(CheckpointIO):
    """``path`` is a checkpoint directory (see xtrain/checkpoint/__init__.py).

    ``save_checkpoint`` snapshots the tensors to host memory on the caller's thread, then a
    background thread writes them, retrying with backoff when storage fails, and commits. At most
    one save is in flight, so the extra host memory is bounded by one snapshot (this host's share
    of the weights and optimizer state). ``wait()`` blocks until the save committed (the final
    and the preemption saves use it). ``sharded``, ``rank``, ``process_group``: see
    :mod:`xtrain.checkpoint.io`. ``peer_lost``: on several processes, a function naming a process
    that vanished (or None); a save is collective, so no process retries it once any finds a peer
    gone.
    ``fence``: see ``ckpt_io.write`` (the checkpoint dir's lease, on the first host): once it
    says the lease was lost, the next save ends the training on every process (LeaseLost).
    """

    def __init__(self, retries: int = 5, backoff_s: float = 1.0, sharded: bool = False,
                 rank: int = 0, process_group=None, peer_lost=None):
        self.retries, self.backoff_s = retries, backoff_s
        self.sharded, self.rank, self.process_group = sharded, rank, process_group
        self.peer_lost = peer_lost
        self.on_commit = None  # called from the upload thread with {"path", "ckpt_s", ...}
        self.fence = None
        self.lost: LeaseLost | None = None  # raised by an upload: the next save raises it
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="xtrain-ckpt")
        self._inflight = None

    def save_checkpoint(self, checkpoint, path, storage_options=None):
        self.wait()
        if self.lost is not None:
            raise self.lost
        check_fence(self.fence, self.rank, self.process_group)
        t0 = time.perf_counter()
        skeleton, tensors = ckpt_io.split_tensors(checkpoint)
        snapshot = ckpt_io.snapshot(tensors, self.sharded)
        rest = io.BytesIO()
        torch.save(skeleton, rest)
        meta = {"step": checkpoint.get("global_step"), "saved_at": time.time(),
                **checkpoint.get("xtrain_meta", {})}
        blocking = time.perf_counter() - t0
        self._inflight = self._pool.submit(self._upload, str(path), snapshot, rest.getvalue(), meta,
                                           t0, blocking)

    def _upload(self, path: str, snapshot: dict, rest: bytes, meta: dict, t0: float, blocking: float):
        delay = self.backoff_s
        for attempt in range(self.retries + 1):
            try:
                ckpt_io.write(path, snapshot, rest, meta, sharded=self.sharded, rank=self.rank,
                              process_group=self.process_group, fence=self.fence)
                break
            except LeaseLost as e:  # another training holds the dir now: never retried
                ckpt_io.warn(f"checkpoint {path} not saved: {e}")
                self.lost = e
                return None
            except (Exception, CheckpointException) as e:  # storage errors come in many types;
                # DCP wraps them in CheckpointException, a BaseException
                why = failure(e, path, _nbytes(snapshot) + len(rest))
                if attempt == self.retries:
                    ckpt_io.warn(f"giving up on checkpoint {path} after {attempt + 1} attempts ({why}); "
                                 "the previous checkpoint stays the newest")
                    return None
                lost = self._lost_together()
                if lost:
                    ckpt_io.warn(f"giving up on checkpoint {path}: {lost}; "
                                 "the previous checkpoint stays the newest")
                    return None
                ckpt_io.warn(f"checkpoint upload to {path} failed ({why}); "
                             f"retrying in {delay:.0f} s ({attempt + 1}/{self.retries})")
                time.sleep(delay)
                delay *= 2
        result = {"path": path, "step": meta["step"], "ckpt_s": round(time.perf_counter() - t0, 3),
                  "ckpt_blocking_s": round(blocking, 3)}
        if self.on_commit and self.rank == 0:
            try:
                self.on_commit(result)
            except Exception as e:  # noqa: BLE001  (storage errors come in many types)
                # the commit stands: retention's listing or the report failing must not fail
                # the next save, or the final one
                ckpt_io.warn(f"checkpoint {path} committed, but the work after its commit failed "
                             f"({type(e).__name__}: {e}); retention tries again after the next commit")
        return result

    def _lost_together(self) -> str | None:
        """Why every process gives up a failed save instead of retrying it, or None: one verdict
        for all (a save is collective, so a lone retry would wait in its first collective for
        processes that gave up). A process that finds a peer vanished, or cannot reach the others
        to agree, gives up; so do the others once told."""
        if self.process_group is None:
            return None
        import torch.distributed as dist

        mine = f"a process vanished ({lost})" if self.peer_lost and (lost := self.peer_lost()) \
            else None
        verdicts = [None] * dist.get_world_size(self.process_group)
        try:
            dist.all_gather_object(verdicts, mine, group=self.process_group)
        except Exception as e:  # noqa: BLE001  (gloo's errors: a reset, a timeout...)
            return mine or f"the processes could not agree to retry ({type(e).__name__}: {e})"
        return next((f"rank {rank}: {v}" for rank, v in enumerate(verdicts) if v), None)

    def wait(self):
        """Block until the in-flight upload (if any) has committed or given up (None)."""
        if self._inflight is not None:
            inflight, self._inflight = self._inflight, None
            return inflight.result()
        return None

    def teardown(self) -> None:
        self.wait()

    def load_checkpoint(self, path, map_location=None, weights_only=True, targets: dict | None = None):
        # weights_only is always True, whatever the caller asks: a checkpoint is untrusted input
        return ckpt_io.read(path, targets, sharded=self.sharded, process_group=self.process_group)

    def remove_checkpoint(self, path):
        remove(str(path))
