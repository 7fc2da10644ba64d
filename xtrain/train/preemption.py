"""Stopping at a step boundary when the process is told to stop (SIGTERM from a spot preemption,
Ctrl-C), so a checkpoint is written and never in the middle of an update."""

from __future__ import annotations

import signal

import torch


class StopRequest:
    """SIGINT/SIGTERM handler that only raises a flag: the run stops at the next step boundary,
    after a checkpoint.

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
