"""Checkpoints through fsspec (local paths or gs://), committed atomically, found on restart.

Layout: ``<dir>/step_000100/{state.pt, meta.json, COMMITTED}``. ``COMMITTED`` is written last,
after every other byte is durable: a checkpoint without it is incomplete (a crash mid-save) and is
never chosen for resume. Object stores have no atomic directory rename, so the marker (as Orbax's
``commit_success.txt``) is the commit on every filesystem. Loading is a trust boundary:
``torch.load(weights_only=True)`` and JSON metadata, never pickle.

Lightning's own ``TorchCheckpointIO``/``XLACheckpointIO`` write with a plain ``torch.save`` to a
local path (neither atomic nor fsspec), hence this CheckpointIO.
"""

from __future__ import annotations

import io
import json
import re
import time

import fsspec
import lightning as L
import torch
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO

COMMIT_MARKER = "COMMITTED"
_STEP_DIR = re.compile(r"step_(\d+)$")


def _fs(path: str):
    return fsspec.core.url_to_fs(path)


def step_dir(directory: str, step: int) -> str:
    return f"{directory.rstrip('/')}/step_{step:06d}"


def committed_checkpoints(directory: str) -> list[tuple[int, str]]:
    """(step, path) of complete checkpoints under ``directory``, oldest first."""
    fs, root = _fs(directory)
    fs.invalidate_cache()  # gcsfs caches listings: a stale one would hide the newest checkpoint
    if not fs.exists(root):
        return []
    found = []
    for entry in fs.ls(root, detail=False):
        m = _STEP_DIR.search(entry.rstrip("/"))
        if m and fs.exists(f"{entry.rstrip('/')}/{COMMIT_MARKER}"):
            found.append((int(m.group(1)), f"{directory.rstrip('/')}/{m.group(0)}"))
    return sorted(found)


def latest_checkpoint(directory: str) -> str | None:
    found = committed_checkpoints(directory)
    return found[-1][1] if found else None


class FsspecCheckpointIO(CheckpointIO):
    """Lightning CheckpointIO: ``path`` is a checkpoint directory (see the module docstring)."""

    def save_checkpoint(self, checkpoint, path, storage_options=None):
        fs, root = _fs(str(path))
        if fs.exists(root):  # an incomplete attempt at this step; never a committed one we keep
            fs.rm(root, recursive=True)
        fs.makedirs(root, exist_ok=True)
        buf = io.BytesIO()
        torch.save(checkpoint, buf)
        fs.pipe_file(f"{root}/state.pt", buf.getvalue())
        meta = {"step": checkpoint.get("global_step"), "bytes": buf.tell(), "saved_at": time.time(),
                **checkpoint.get("xtrain_meta", {})}
        fs.pipe_file(f"{root}/meta.json", json.dumps(meta, indent=2).encode())
        fs.pipe_file(f"{root}/{COMMIT_MARKER}", b"")

    def load_checkpoint(self, path, map_location=None, weights_only=True):
        # weights_only is always True here, whatever the caller asks: a checkpoint is untrusted input.
        fs, root = _fs(str(path))
        if not fs.exists(f"{root}/{COMMIT_MARKER}"):
            raise FileNotFoundError(f"{path}: not a committed checkpoint (no {COMMIT_MARKER})")
        data = fs.cat_file(f"{root}/state.pt")
        return torch.load(io.BytesIO(data), map_location=map_location or "cpu", weights_only=True)

    def remove_checkpoint(self, path):
        fs, root = _fs(str(path))
        fs.rm(root, recursive=True)


class PeriodicCheckpoint(L.Callback):
    """Saves every ``every`` steps and at the end; keeps the newest ``keep_last`` checkpoints."""

    def __init__(self, directory: str, every: int, keep_last: int = 2, meta: dict | None = None):
        self.directory, self.every, self.keep_last = directory.rstrip("/"), every, keep_last
        self.meta = meta or {}
        self.last_saved_step = None
        self.save_seconds = []

    def save(self, trainer) -> None:
        step = trainer.global_step
        if step == self.last_saved_step:
            return
        t0 = time.perf_counter()
        trainer.save_checkpoint(step_dir(self.directory, step))
        self.save_seconds.append(time.perf_counter() - t0)
        self.last_saved_step = step
        if trainer.is_global_zero:
            for _, old in committed_checkpoints(self.directory)[:-self.keep_last]:
                trainer.strategy.checkpoint_io.remove_checkpoint(old)

    def on_save_checkpoint(self, trainer, pl_module, checkpoint):
        checkpoint["xtrain_meta"] = self.meta

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.every and trainer.global_step % self.every == 0:
            self.save(trainer)

    def on_train_end(self, trainer, pl_module):
        self.save(trainer)
