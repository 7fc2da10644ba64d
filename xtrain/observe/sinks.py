"""Where records go, behind one interface (:class:`Sink`): ``metrics.jsonl`` (:class:`JsonlSink`),
any Lightning logger (:class:`LightningSink`: W&B, TensorBoard) and the console
(xtrain/observe/console.py). :class:`RunLog` hands each record to all of them.

A record is a flat dict with ``step``, ``kind`` (train, val, eval, checkpoint, sample, preemption:
a re-run's, stop: why a run stopped before its end, xtrain/observe/preemptions.py) and ``time``
(Unix seconds). Records are written from rank 0 only, from the training thread and from
the checkpoint upload thread, so writes are serialised by a lock.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import math
import os
import threading
import time

from xtrain.errors import EXIT_STOPPED, warn
from xtrain.paths import is_local, url_to_fs

KINDS = ("train", "val", "eval", "checkpoint", "sample", "preemption", "stop")


class Sink:
    def write(self, record: dict) -> bool | None:
        """False: the record is only kept for later (a remote file between uploads), which says
        nothing of whether the sink works."""
        raise NotImplementedError

    def close(self, status: str = "success") -> None:
        """``status``: success, preempted or failed."""

    def __str__(self) -> str:  # (how a failure names the sink)
        return type(self).__name__


class RunLog:
    """Every sink of a run behind one call. ``record(kind, step, values)`` is the one path for
    training metrics, validation, evaluation scores (e.g. ``cpp_pass_rate``), checkpoint timings
    and samples."""

    def __init__(self, sinks: list[Sink]):
        self.sinks = sinks
        self._lock = threading.Lock()
        self._failing: set[int] = set()  # (ids of the sinks whose last call failed)

    def record(self, kind: str, step: int, values: dict) -> dict:
        if kind not in KINDS:
            raise ValueError(f"record kind {kind!r}: expected one of {KINDS}")
        record = {"step": int(step), "kind": kind, **values, "time": round(time.time(), 3)}
        with self._lock:
            for sink in self.sinks:
                self._call(sink, "write", record)
        return record

    def close(self, status: str = "success") -> None:
        with self._lock:
            for sink in self.sinks:
                self._call(sink, "close", status)

    def _call(self, sink: Sink, method: str, arg) -> None:
        """One sink's failure (an upload that gave up, a full disk, a logger's service gone) is
        said once until the sink works again; the other sinks, the training and the run's
        outcome go on (AppendFile keeps the lines: an upload is retried with the first record a
        flush interval later)."""
        try:
            kept_for_later = getattr(sink, method)(arg) is False
        except Exception as e:  # noqa: BLE001  (any library's error: named, then passed over)
            if id(sink) not in self._failing:
                self._failing.add(id(sink))
                cause = e.__cause__  # (Lightning's loggers re-raise the error as another)
                why = f"{type(e).__name__}: {e}" + (f"; from {type(cause).__name__}: {cause}" if cause else "")
                warn(f"{sink}: {method} failed ({why}); the run goes on, its other records too")
            return
        if not kept_for_later:
            self._failing.discard(id(sink))


class AppendFile:
    """A text file appended to through fsspec (local paths and gs://). Object stores cannot
    append: a remote file is rewritten whole (continuing an existing one, e.g. on resume), at
    most every ``remote_flush_s`` seconds and at ``close``, so uploads stay bounded on long runs."""

    def __init__(self, path: str, remote_flush_s: float = 30.0):
        self.path = path
        self._fs, self._root = url_to_fs(path)
        self._fs.makedirs(self._root.rsplit("/", 1)[0], exist_ok=True)
        self._local = is_local(path)
        self._lines: list[str] = []
        self.remote_flush_s, self._flushed_at = remote_flush_s, 0.0
        self._lock = threading.Lock()
        self._writer: int | None = None  # the thread inside write or close, holding the lock
        self._held: collections.deque[str] = collections.deque()  # lines the next write takes
        # a line cut short (a VM stopped, a disk filled mid-write) is ended before the next one,
        # which it would otherwise swallow
        self._check_end = True
        if not self._local and self._fs.exists(self._root):
            self._lines = self._fs.cat_file(self._root).decode().splitlines(keepends=True)
            if self._lines and not self._lines[-1].endswith("\n"):
                self._lines[-1] += "\n"

    def _cut_short(self) -> bool:
        with contextlib.suppress(FileNotFoundError), open(self._root, "rb") as f:
            if f.seek(0, os.SEEK_END):
                f.seek(-1, os.SEEK_END)
                return f.read(1) != b"\n"
        return False

    def write(self, text: str) -> bool:
        """Append ``text``; whether the file was written (not when the line is held, or kept for
        a remote file's next upload). A line logged from inside this file's own write (a library
        warning during the upload: gcsfs logs on fsspec's event-loop thread, in the middle of
        ``pipe_file``) is held for the next write or ``close``: waiting for the lock there, or
        uploading from inside the loop, would never return."""
        if self._writer == threading.get_ident() or self._on_its_loop():
            self._held.append(text)
            return False
        with self._writing():
            due = time.monotonic() - self._flushed_at >= self.remote_flush_s
            return self._append(self._take_held() + text, upload=due)

    def close(self) -> bool:
        with self._writing():
            return self._append(self._take_held(), upload=True)

    def _on_its_loop(self) -> bool:
        """On the event loop the file's filesystem runs its requests on (an async one's, such as
        gcsfs: fsspec's IO thread), where a blocking call to it cannot return."""
        loop = getattr(self._fs, "loop", None)
        try:
            return loop is not None and asyncio.get_running_loop() is loop
        except RuntimeError:
            return False

    @contextlib.contextmanager
    def _writing(self):
        with self._lock:
            self._writer = threading.get_ident()
            try:
                yield
            finally:
                self._writer = None

    def _take_held(self) -> str:
        taken = []
        while self._held:
            taken.append(self._held.popleft())
        return "".join(taken)

    def _append(self, text: str, upload: bool) -> bool:
        if not self._local:
            if text:
                self._lines.append(text)
            if upload:
                try:
                    self._fs.pipe_file(self._root, "".join(self._lines).encode())
                finally:  # a failed upload too: during an outage, not every line waits its retries
                    self._flushed_at = time.monotonic()
            return upload
        if not text:
            return True
        if self._check_end:
            text = "\n" + text if self._cut_short() else text
            self._check_end = False
        try:
            with self._fs.open(self._root, "a") as f:
                f.write(text)
        except BaseException:
            self._check_end = True  # part of it may be written
            raise
        return True


def strict_json(value):
    """``value`` with every NaN or infinity as None: JSON has no such numbers (Python's ``json``
    writes ``NaN``, which strict parsers refuse)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: strict_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict_json(v) for v in value]
    return value


class JsonlSink(Sink):
    """``metrics.jsonl``: one JSON object per record (the run's own record of its metrics; a
    value that is not a finite number, a diverged run's loss, is null)."""

    def __init__(self, run_dir: str, filename: str = "metrics.jsonl"):
        self.file = AppendFile(f"{run_dir.rstrip('/')}/{filename}")
        self.path = self.file.path

    def __str__(self) -> str:
        return self.path

    def write(self, record: dict) -> bool:
        return self.file.write(json.dumps(strict_json(record), allow_nan=False) + "\n")

    def close(self, status: str = "success") -> None:
        self.file.close()


class LightningSink(Sink):
    """A Lightning logger (``lightning.pytorch.loggers``): numbers through ``log_metrics`` at the
    record's step, samples as text (a W&B table, TensorBoard text). The record's ``kind`` and
    ``time`` stay out (both loggers keep their own wall-clock time)."""

    def __init__(self, logger):
        self.logger = logger

    def __str__(self) -> str:
        return type(self.logger).__name__

    def write(self, record: dict) -> None:
        step = record["step"]
        numbers = {k: v for k, v in record.items() if k not in ("step", "time")
                   and isinstance(v, (int, float)) and not isinstance(v, bool)}
        if numbers:
            self.logger.log_metrics(numbers, step=step)
        if record.get("samples"):
            self._log_samples(step, record["samples"])

    def _log_samples(self, step: int, samples: list[dict]) -> None:
        from lightning.pytorch.loggers import TensorBoardLogger, WandbLogger

        if isinstance(self.logger, WandbLogger):
            self.logger.log_text(key="samples", columns=["step", "prompt", "text"],
                                 data=[[step, s["prompt"], s["text"]] for s in samples], step=step)
        elif isinstance(self.logger, TensorBoardLogger):
            for i, s in enumerate(samples):  # TensorBoard renders text as markdown
                self.logger.experiment.add_text(f"samples/{i}", f"```\n{s['prompt']}{s['text']}\n```", step)

    def close(self, status: str = "success") -> None:
        from lightning.pytorch.loggers import WandbLogger

        self.logger.finalize("success" if status == "success" else "failed")
        if isinstance(self.logger, WandbLogger):
            import wandb

            run = self.logger.experiment
            if status == "preempted":
                run.mark_preempting()  # W&B shows it as preempted, to be resumed
            run.finish(exit_code={"success": 0, "preempted": EXIT_STOPPED}.get(status, 1))
            # finish() can return before W&B's service process has written and closed the run's
            # file (wandb 0.31 tells the service the run is done without waiting); teardown
            # waits for that process to exit, so a closed RunLog leaves a complete run file (a
            # sweep's next job starts a service of its own)
            wandb.teardown()
