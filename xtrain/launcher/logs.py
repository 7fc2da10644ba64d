"""Workers' logs on the local side: each worker's remote log streamed into
``<job dir>/worker-<i>.log`` and onto the console, every line prefixed with the worker index."""

from __future__ import annotations

import glob
import os
import queue
import re
import threading
import time

_print_lock = threading.Lock()


def log_path(job_dir: str, index: int) -> str:
    return os.path.join(job_dir, f"worker-{index}.log")


# The console line of a training record (xtrain/observe/console.py, train_line).
STEP_LINE = re.compile(rb"^step\s+(\d+)/\d+ \| loss")


def last_logged_step(path: str) -> int | None:
    with open(path, "rb") as f:
        steps = [int(m.group(1)) for line in f if (m := STEP_LINE.match(line))]
    return steps[-1] if steps else None


def worker_logs(job_dir: str) -> list[int]:
    """The workers whose log of the latest attempt is in ``job_dir``."""
    names = (os.path.basename(p) for p in glob.glob(os.path.join(glob.escape(job_dir), "worker-*.log")))
    return sorted(int(m[1]) for name in names if (m := re.fullmatch(r"worker-(\d+)\.log", name)))


def kept_aside(job_dir: str, index: int) -> str:
    """Where worker ``index``'s log of a preempted attempt is kept: the first free
    ``worker-<i>.preempted-<n>.log`` (a later launch of the same command numbers on)."""
    n = 1
    while os.path.exists(path := os.path.join(job_dir, f"worker-{index}.preempted-{n}.log")):
        n += 1
    return path


def furthest_logged_step(job_dir: str) -> int | None:
    """The furthest training step worker 0's local logs (every attempt's) show."""
    paths = [log_path(job_dir, 0), *glob.glob(os.path.join(glob.escape(job_dir),
                                                           "worker-0.preempted-*.log"))]
    steps = [s for p in paths if os.path.exists(p) and (s := last_logged_step(p)) is not None]
    return max(steps, default=None)


def tail_lines(path: str, lines: int = 30) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.path.getsize(path) - 64 * 1024))
            text = f.read().decode(errors="replace")
    except FileNotFoundError:
        return "(no log)"
    return "\n".join(text.rstrip("\n").splitlines()[-lines:])


class LogStream(threading.Thread):
    """Follows one job's log from byte ``offset``; puts the worker index on ``ended`` when the
    stream stops (the job ended, or the connection dropped: the launcher polls to tell which).
    ``whole`` says whether it ended by itself (tail's exit 0: the log was read to the job's end).
    Each line also goes to ``on_line``, when given."""

    def __init__(self, job, path: str, offset: int, ended: queue.Queue, echo=print, on_line=None):
        super().__init__(daemon=True, name=f"xtrain-log-{job.worker.index}")
        self.job, self.path, self.offset, self.ended, self.echo = job, path, offset, ended, echo
        self.on_line = on_line
        self.index = job.worker.index
        self.proc = None
        self.whole = False
        self.opened, self.closed_at = (time.monotonic(), offset), None

    def run(self) -> None:
        try:
            self.proc = self.job.follow(self.offset)
            with open(self.path, "ab") as f:
                for line in iter(self.proc.stdout.readline, b""):
                    f.write(line)
                    f.flush()
                    self.offset += len(line)
                    text = line.decode(errors="replace").rstrip("\n")
                    with _print_lock:
                        self.echo(f"[w{self.index}] {text}")
                    if self.on_line is not None:
                        self.on_line(text)
            self.whole = self.proc.wait() == 0
        finally:
            self.closed_at = time.monotonic()
            self.ended.put(self.index)

    def worked(self, lived_s: float) -> bool:
        """Whether the stream, once ended, had brought new lines or lasted ``lived_s``: a working
        connection."""
        since, offset = self.opened
        return self.offset > offset or self.closed_at - since > lived_s

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait()
