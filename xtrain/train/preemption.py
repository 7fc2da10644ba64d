"""Stopping at a step boundary when the run is told to stop (SIGTERM from a spot preemption,
Ctrl-C, or a GCE preemption/maintenance notice from xtrain/train/notices.py), so a checkpoint is
written and never in the middle of an update; on several processes, all of them at the same step."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import threading

from xtrain.errors import EXIT_INTERRUPTED, Terminated
from xtrain.observe.preemptions import NOTICE, SIGNAL

log = logging.getLogger(__name__)

# what stopped the run, weakest first: the processes agree on the strongest (a vote of indices),
# so a GCE notice on any host makes the whole run's stop the VM's, not the job's own
CAUSES = (None, SIGNAL, NOTICE)


# set once :func:`sigterm_raises` raised Terminated: code it interrupted may have turned it into an
# error of its own (a C extension's import leaves an ImportError), which is then still a stop
SIGTERM_RAISED = threading.Event()


@contextlib.contextmanager
def sigterm_raises():
    """SIGTERM raises Terminated inside (from training's start to the end's records,
    StopRequest's handler stands in for it, and once the end is done :func:`say_end_done`): a stop
    during a run's start-up leaves by the clean-up a Ctrl-C takes, instead of ending the process
    where it is, the checkpoint lease left for the next start to wait out."""
    def handle(signum, frame):
        SIGTERM_RAISED.set()
        raise Terminated()

    if threading.current_thread() is not threading.main_thread():  # (only it may set handlers)
        yield
        return
    previous = signal.signal(signal.SIGTERM, handle)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


class StopRequest:
    """A stop request, raised by SIGINT/SIGTERM or by :meth:`request` (any thread), acted on at
    the next agreed step boundary (:meth:`agreed`), after a checkpoint.

    The signal handler replaces Lightning's SIGTERM handling for the whole fit (Lightning's own
    is never installed: xtrain.compat.keep_signal_handlers): Lightning checks its flag after the
    step's callbacks and would stop a step later without a checkpoint, or on pods at a step of
    rank 0's choosing while the other hosts are saving, and its handler broadcasts over
    torch.distributed, which deadlocks a signal that arrives during a collective.

    ``processes`` (xtrain/engines/processes.py): on several processes a request on any one of
    them stops all of them at the same step (a save is collective). The processes vote at every
    step boundary without waiting for the result: it is read at the next boundary, so on a pod
    the vote is in flight while the TPUs compute; on the CPU engine it queues behind DDP's
    gradient all-reduce on the same gloo group (about a millisecond a step: BENCHMARKS.md, "stop
    agreement"). A request is acted on one or two steps after it arrives.

    ``stopped_for`` is set when the processes agree to stop: SIGNAL or NOTICE (:data:`CAUSES`),
    a notice on any process winning; xtrain/train/run.py records it for the launcher.
    """

    def __init__(self, processes=None):
        self.reason: str | None = None
        self.cause: str | None = None  # this process's: CAUSES
        self.stopped_for: str | None = None  # every process's, agreed
        self.processes = processes
        self._previous = {}
        self._pending = None  # the vote started at the previous step boundary
        self._watch: SignalWatch | None = None
        self.past_last_step = threading.Event()  # training reached its last step: no boundary left
        self.end_done = threading.Event()  # the run's outcome is decided: a stop changes nothing

    @property
    def requested(self) -> bool:
        return self.reason is not None

    def request(self, reason: str, cause: str = SIGNAL) -> None:
        """Ask the run to stop; the first reason is kept (for the final message), unless a GCE
        notice follows a signal: the stop is then the VM's."""
        if CAUSES.index(cause) > CAUSES.index(self.cause):
            self.reason, self.cause = reason, cause

    def notice(self, reason: str) -> None:
        """A GCE notice (xtrain/train/notices.py): the VM is about to stop or go into maintenance."""
        self.request(reason, NOTICE)

    def install(self) -> None:
        """Handle SIGINT/SIGTERM from now on; ``uninstall`` restores the first call's handlers."""
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous = signal.signal(sig, self._handle)
            self._previous.setdefault(sig, previous)
        self._watch = self._watch or SignalWatch(self.past_last_step, self.end_done)

    def uninstall(self) -> None:
        """Restore the handlers :meth:`install` replaced; once the run's end is done, a SIGTERM from
        then on is only said: raised as sigterm_raises would, it would turn the finished run into a
        stopped one (exit 143), or be lost as an "Exception ignored" in a finalizer. (Ctrl-C still
        interrupts what is left.)"""
        for sig, handler in self._previous.items():
            ended = sig == signal.SIGTERM and self.end_done.is_set()
            signal.signal(sig, say_end_done if ended else handler)
        self._previous = {}
        if self._watch:
            self._watch.close()
            self._watch = None

    def _handle(self, signum, frame):
        self.request(signal.Signals(signum).name)

    def agreed(self) -> bool:
        """Whether to stop now; call at every step boundary, on every process. True on every
        process at the same step once any of them was asked to stop."""
        if self.processes is None or self.processes.world == 1:
            agreed = CAUSES.index(self.cause)
        else:
            pending, self._pending = self._pending, self.processes.vote(CAUSES.index(self.cause))
            agreed = pending() if pending is not None else 0
        if agreed:
            self.stopped_for = CAUSES[agreed]
        return bool(agreed)

    def settle(self) -> None:
        """Wait for the vote in flight (at the end of training: every process has one)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending()


def say_end_done(signum, frame=None) -> None:
    log.warning("%s: the run's end was already done; it exits as it was about to",
                signal.Signals(signum).name)


class SignalWatch:
    """Says at once that a stop signal arrived, and ends the process on a second Ctrl-C (exit
    ``EXIT_INTERRUPTED``, without a checkpoint), also while the main thread is inside one long
    native call (a compile, a huge step), where Python's signal handlers wait until it returns.
    Python's C-level handler writes each handled signal's number to the wakeup fd
    (``signal.set_wakeup_fd``), which this class's thread reads as it arrives."""

    def __init__(self, past_last_step: threading.Event | None = None,
                 end_done: threading.Event | None = None):
        self.past_last_step = past_last_step or threading.Event()
        self.end_done = end_done or threading.Event()
        self._reader, self._writer = socket.socketpair()
        self._writer.setblocking(False)
        self._previous_fd = signal.set_wakeup_fd(self._writer.fileno(), warn_on_full_buffer=False)
        self._seen: list[int] = []
        threading.Thread(target=self._read, name="xtrain-signals", daemon=True).start()

    def _read(self) -> None:
        while data := self._reader.recv(64):
            for signum in data:
                if signum in (signal.SIGINT, signal.SIGTERM):
                    self._arrived(signal.Signals(signum))

    def _arrived(self, sig: signal.Signals) -> None:
        if sig == signal.SIGINT and signal.SIGINT in self._seen:
            log.warning("SIGINT again: stopping now, without a checkpoint (the last committed one "
                        "resumes)")
            os._exit(EXIT_INTERRUPTED)
        if not self._seen and self.end_done.is_set():
            say_end_done(sig)
        elif not self._seen and self.past_last_step.is_set():
            log.warning("%s: training reached its last step; stopping what the run's end still "
                        "does (the same command again finishes it)", sig.name)
        elif not self._seen:
            again = "; Ctrl-C again stops now, without one" if sig == signal.SIGINT else ""
            log.warning("%s: stopping at the next step boundary, after a checkpoint%s", sig.name, again)
        self._seen.append(sig)

    def close(self) -> None:
        signal.set_wakeup_fd(self._previous_fd)
        self._writer.close()  # the thread's recv returns b"" and it ends
