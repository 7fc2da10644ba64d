"""Training metrics, computed at logging steps and handed to the run's sinks (:class:`RunLog`).

Device values (loss, gradient norm, the learning-rate multiplier) are read in one transfer per
logging interval (``engine.fetch``) and at evaluations, never at other steps, so logging adds no
host sync to the XLA engine's steps. Lightning's progress bar stays off for the same reason; the
console display (xtrain/observe/console.py) is refreshed from these records.

``loss`` is the step's float32 loss unrounded (JSON keeps every digit, so runs compare exactly).
``tokens`` is counted from the batches the steps received: micro-batches x rows x sequence_len
per step ([B, A, T+1] holds T targets per row; training rows are never padded, see
xtrain/data/loader.py), times ``batch_shares`` (the processes whose batches make up the step:
xtrain/engines/base.py); checkpointed with the run.

A train record holds: ``loss``, ``lr`` (the matrix group's), ``grad_norm`` (before clipping),
``tokens``, ``tok_per_s`` and ``tok_per_s_per_chip`` (evaluation and sampling time excluded),
``mfu`` (FLOPs per token as in xtrain/plan.py, against the peak the run was given), the mean
step time ``step_s`` split into ``compute_s`` (the step as the host sees it: on the XLA engine
tracing and dispatch, and waiting for the device where it must, the logging fetch included),
``checkpoint_s`` (the blocking part of saves) and ``data_s`` (the rest: waiting for the next
batch and loop overhead), ``elapsed_s`` (training seconds since the run first started, carried
over resumes like ``tokens``) and ``eta_s``. Validation records hold ``val_loss``, ``val_bpb`` and ``eval_s``.
"""

from __future__ import annotations

import math
import threading
import time
from collections import defaultdict
from contextlib import contextmanager

import lightning as L
from lightning.pytorch.utilities.exceptions import SIGTERMException

from xtrain.errors import warn
from xtrain.observe import preemptions
from xtrain.observe.sinks import RunLog


class PhaseTimer:
    """Seconds spent in named phases (checkpoint, eval, sample) since the last ``take``."""

    def __init__(self):
        self._seconds = defaultdict(float)
        self._lock = threading.Lock()

    @contextmanager
    def measure(self, phase: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            with self._lock:
                self._seconds[phase] += time.perf_counter() - t0

    def add(self, phase: str, seconds: float) -> None:
        with self._lock:
            self._seconds[phase] += seconds

    def take(self) -> dict[str, float]:
        with self._lock:
            out, self._seconds = dict(self._seconds), defaultdict(float)
        return out


class MetricsLogger(L.Callback):
    """``peak_flops``: the whole run's peak FLOP/s (0: no MFU); ``chips``: devices of the run.
    ``peak_measured``: the peak is this CPU's measured one, a lower bound: should the steps go
    faster (the CPU was busy when it was measured), the fastest interval is the peak (said once)."""

    def __init__(self, run_log: RunLog, log_every: int, max_steps: int,
                 flops_per_token: float = 0.0, peak_flops: float = 0.0, chips: int = 1,
                 timer: PhaseTimer | None = None, extra=None, fetch=None, batch_shares: int = 1,
                 peak_measured: bool = False):
        self.run_log, self.log_every = run_log, log_every
        self.max_steps, self.flops_per_token, self.peak_flops = max_steps, flops_per_token, peak_flops
        self.peak_measured, self._peak_raised = peak_measured, False
        self._diverged = False  # a non-finite loss was said
        self.chips = chips
        self.timer = timer or PhaseTimer()
        self.extra = extra or (lambda: {})  # engine counters (XLA compiles, host syncs)
        # device tensors -> Python floats in one transfer (the engine knows how)
        self.fetch = fetch or (lambda tensors: [float(t) for t in tensors])
        self._started = self._t0 = self._batch_t0 = self._eta_from = None
        self._step0 = self._first_step = 0
        self._logged_step = None
        self.batch_shares = batch_shares
        self.tokens = 0  # consumed by the steps so far (this run and the ones it resumed)
        self._tokens0 = 0
        self._compute = 0.0
        self._elapsed0 = 0.0  # training seconds of the runs this one resumed, up to their checkpoint
        self._saved_elapsed = None  # the newest checkpoint's elapsed_s

    def state_dict(self) -> dict:
        self._saved_elapsed = self._elapsed(time.perf_counter())
        return {"tokens": self.tokens, "elapsed_s": self._saved_elapsed}

    def load_state_dict(self, state: dict) -> None:
        self.tokens = state["tokens"]
        self._elapsed0 = state.get("elapsed_s", 0.0)  # (checkpoints from before it was recorded)

    def _elapsed(self, now: float) -> float:
        return self._elapsed0 + (now - self._started if self._started is not None else 0.0)

    def on_train_start(self, trainer, pl_module):
        self._started = self._t0 = time.perf_counter()
        self._step0, self._tokens0 = trainer.global_step, self.tokens
        # this start's first step is always logged (step 1 of a new run): a resumed run's first
        # record then marks where the records of the attempt it resumed stop counting
        # (xtrain/observe/plots.py read_records), whatever trainer.log_every is now
        self._first_step = trainer.global_step + 1
        self.timer.take()
        self.record_preemptions(trainer.global_step, trainer.global_rank)

    def record_preemptions(self, step: int, rank: int) -> None:
        """A re-run's ``preemption`` record (xtrain/observe/preemptions.py) at ``step``, where it
        resumes: at the start of training, or (xtrain/train/finish.py) in the end's work of a run
        resumed at its last step, whose fit calls no hook."""
        resumed = preemptions.record(step)
        if resumed and rank == 0:
            step = resumed.pop("step")
            self.run_log.record("preemption", step, resumed)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._batch_t0 = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        now = time.perf_counter()
        self._compute += now - self._batch_t0
        rows = batch[0]  # [rows, micro-batches, T+1] on this process; a host-side shape, no device read
        self.tokens += rows.numel() // rows.shape[-1] * (rows.shape[-1] - 1) * self.batch_shares
        step = trainer.global_step
        if step % self.log_every and step not in (self._first_step, trainer.max_steps):
            return
        self._log(trainer, pl_module, step, now)

    def on_exception(self, trainer, pl_module, exception):
        # a stop (xtrain/train/checkpointing.py raises it on every process at the same step,
        # after the step's checkpoint): that step's loss is recorded, as a last step's is, with
        # that checkpoint's elapsed_s (which the resumed run's records go on from); the resumed
        # run's records begin after it
        if isinstance(exception, SIGTERMException) and self._logged_step != trainer.global_step:
            try:
                self._log(trainer, pl_module, trainer.global_step, time.perf_counter(),
                          elapsed=self._saved_elapsed)
            except Exception as e:  # noqa: BLE001  (a peer gone since the stop's checkpoint)
                # the stop's exit status matters more than the record (the launcher reads it)
                warn(f"the loss of step {trainer.global_step} was not recorded ({type(e).__name__}: {e})")

    def _log(self, trainer, pl_module, step: int, now: float, elapsed: float | None = None) -> None:
        """``elapsed``: the record's elapsed_s, when not the time until ``now``."""
        self._logged_step = step
        # every process: under DDP each holds its own rows' loss and this is a collective; under
        # SPMD the loss is already the global one and this does nothing
        loss = trainer.strategy.reduce(pl_module.last_loss, reduce_op="mean")
        if not trainer.is_global_zero:
            return
        opt = pl_module.optimizers().optimizer
        # the one device-to-host transfer of this logging interval; under XLA it waits for the
        # device to finish the interval's steps, which is compute time
        loss, lr_mult, grad_norm = self.fetch([loss, opt.last_lr_multiplier(),
                                               pl_module.step_stats["grad_norm"]])
        fetched = time.perf_counter()
        self._compute += fetched - now
        if not math.isfinite(loss) and not self._diverged:
            self._diverged = True
            warn(f"the loss is {loss} at step {step}: the training diverged (lower the learning "
                 "rates, optim.*_lr, or keep optim.grad_clip on); its weights are not sampled")
        values = {"loss": loss, "lr": float(f"{opt.param_groups[0]['lr'] * lr_mult:.6g}"),
                  "grad_norm": round(grad_norm, 6), "tokens": self.tokens,
                  **self._rates(step, fetched, elapsed), **self.extra()}
        self.run_log.record("train", step, values)

    def _rates(self, step: int, now: float, elapsed: float | None = None) -> dict:
        """Throughput, MFU and the step-time split over the interval since the last log."""
        steps = max(step - self._step0, 1)
        phases = self.timer.take()
        wall = now - self._t0
        training = max(wall - phases.get("eval", 0.0) - phases.get("sample", 0.0), 1e-9)
        tok_per_s = (self.tokens - self._tokens0) / training
        step_s, compute_s = training / steps, self._compute / steps
        checkpoint_s = phases.get("checkpoint", 0.0) / steps
        out = {"tok_per_s": round(tok_per_s, 1), "tok_per_s_per_chip": round(tok_per_s / self.chips, 1)}
        if self.peak_flops and self.flops_per_token:
            achieved = tok_per_s * self.flops_per_token
            if self.peak_measured and achieved > self.peak_flops:
                if not self._peak_raised:
                    warn(f"the steps reach {achieved / 1e9:.1f} GFLOP/s, above the CPU peak measured "
                         f"at start ({self.peak_flops / 1e9:.1f}; the CPU was busy then?): MFU is "
                         "against the fastest interval's rate from now on")
                self.peak_flops, self._peak_raised = achieved, True
            out["mfu"] = round(achieved / self.peak_flops, 5)
        out.update(step_s=round(step_s, 5), compute_s=round(compute_s, 5),
                   checkpoint_s=round(checkpoint_s, 5),
                   data_s=round(max(step_s - compute_s - checkpoint_s, 0.0), 5))
        # the ETA averages over every step since the first log (compilation excluded) and
        # includes the evaluations and checkpoints still to come
        if self._eta_from is None:
            self._eta_from, eta = (now, step), None
        else:
            t_from, s_from = self._eta_from
            eta = (now - t_from) / max(step - s_from, 1) * (self.max_steps - step)
        out["elapsed_s"] = round(self._elapsed(now) if elapsed is None else elapsed, 1)
        if eta is not None:
            out["eta_s"] = round(eta, 1)
        self._t0, self._step0, self._tokens0, self._compute = now, step, self.tokens, 0.0
        return out

    def on_validation_start(self, trainer, pl_module):
        self._val_t0 = time.perf_counter()

    def on_validation_epoch_end(self, trainer, pl_module):
        if trainer.sanity_checking:
            return
        summary = pl_module.validation_summary()  # every process (a collective under DDP)
        if not trainer.is_global_zero:
            return
        seconds = time.perf_counter() - self._val_t0
        self.timer.add("eval", seconds)  # evaluation time is not training throughput
        self.run_log.record("val", trainer.global_step,
                            {**{k: round(v, 6) for k, v in summary.items()}, "eval_s": round(seconds, 3)})
