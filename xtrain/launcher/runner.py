"""The one object every external command of a launch goes through (ssh, rsync, gcloud, git).

It records each call (argv, seconds, exit code, whether stdin was sent, never what), so tests and
``make bench`` can assert what a launch did (no rsync transfer, no pip install), and the spot-fleet
work can reuse the same plumbing. Standard input is the only channel that carries secrets, which
is why it is never recorded.
"""

from __future__ import annotations

import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from xtrain.errors import LaunchError, VmUnavailable  # noqa: F401  (raised by the launcher modules)


TIMED_OUT = -1  # the return code of a command stopped at its timeout


@dataclass
class Call:
    argv: list[str]
    seconds: float
    returncode: int | None  # None: a stream still running when recorded
    stdin: bool  # stdin was sent (its content is never recorded: it may hold secrets)
    label: str = ""  # what the call was for (probe, sync, install, start, ...): scripts go over stdin


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str

    @property
    def ok(self) -> bool:
        return self.returncode == 0


class Runner:
    """Runs commands and keeps a log of them; thread-safe (workers are handled in parallel)."""

    def __init__(self):
        self.calls: list[Call] = []
        self._lock = threading.Lock()

    def run(self, argv: list[str], input: str | None = None, timeout: float | None = None,
            label: str = "") -> Result:
        t0 = time.perf_counter()
        try:
            p = subprocess.run(argv, input=input, capture_output=True, text=True, timeout=timeout,
                               stdin=None if input is not None else subprocess.DEVNULL)
            result = Result(p.returncode, p.stdout, p.stderr)
        except subprocess.TimeoutExpired as e:
            result = Result(TIMED_OUT, _text(e.stdout),
                            _text(e.stderr) + f"\ntimed out after {timeout} s")
        except FileNotFoundError:
            result = Result(127, "", f"{argv[0]}: command not found")
        self._record(Call(list(argv), time.perf_counter() - t0, result.returncode, input is not None,
                          label))
        return result

    def stream(self, argv: list[str], label: str = "",
               stdin=subprocess.DEVNULL) -> subprocess.Popen:
        """A long-running command whose stdout is read as it comes (a worker's log)."""
        self._record(Call(list(argv), 0.0, None, False, label))
        # stderr is dropped: a stream that ends is followed by a poll, which reports the cause
        return subprocess.Popen(argv, stdin=stdin, stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL)

    def _record(self, call: Call) -> None:
        with self._lock:
            self.calls.append(call)

    def labels(self) -> list[str]:
        with self._lock:
            return [c.label for c in self.calls]


def _text(value) -> str:
    if value is None:
        return ""
    return value.decode(errors="replace") if isinstance(value, bytes) else value


def parallel(fn, items):
    """``fn`` over ``items`` in threads (one per worker); the first error, in worker order, wins."""
    with ThreadPoolExecutor(max_workers=max(1, len(items))) as pool:
        futures = [pool.submit(fn, item) for item in items]
    return [f.result() for f in futures]
