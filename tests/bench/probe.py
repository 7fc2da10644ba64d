"""A Lightning callback timing each training step of xtrain's module and keeping its loss, for the
benchmarks that time xtrain against a bare loop (tests/bench/step_time.py, cpu_peer.py)."""

from __future__ import annotations

import time

import lightning as L


class StepProbe(L.Callback):
    """``times``: each step's wall time, s; ``losses``: each step's loss (a host read after the
    step, which the CPU engine has finished by then)."""

    def __init__(self):
        self.times, self.losses, self.t0 = [], [], None

    def on_train_batch_start(self, *args):
        self.t0 = time.perf_counter()

    def on_train_batch_end(self, trainer, module, *args):
        self.times.append(time.perf_counter() - self.t0)
        self.losses.append(module.last_loss.item())
