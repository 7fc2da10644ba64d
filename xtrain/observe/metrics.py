"""Per-step metrics, computed at logging steps and handed to every sink (xtrain/observe/sinks.py).

Values are read from the device only every ``log_every`` steps (and at evaluations), so logging
adds no host sync to the other steps. Lightning's progress bar is disabled for the same reason.
"""

from __future__ import annotations

import time

import lightning as L

from xtrain.observe.sinks import Sink


class MetricsLogger(L.Callback):
    def __init__(self, sinks: list[Sink], log_every: int, tokens_per_step: int,
                 flops_per_token: float = 0.0, peak_flops: float = 0.0, chips: int = 1,
                 extra=None, fetch=None):
        self.sinks, self.log_every, self.tokens_per_step = sinks, log_every, tokens_per_step
        self.flops_per_token, self.peak_flops, self.chips = flops_per_token, peak_flops, chips
        self.extra = extra or (lambda: {})  # engine-specific counters (e.g. XLA compiles)
        # device tensors -> Python floats in one transfer (the engine knows how)
        self.fetch = fetch or (lambda tensors: [float(t) for t in tensors])
        self._t0 = None
        self._step0 = 0

    def write(self, record: dict) -> None:
        """Hand one record to every sink; thread-safe (checkpoint uploads report from their thread)."""
        for sink in self.sinks:
            sink.write(record)

    def on_train_start(self, trainer, pl_module):
        self._t0, self._step0 = time.perf_counter(), trainer.global_step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        step = trainer.global_step
        if step % self.log_every and step not in (1, trainer.max_steps):
            return
        # every process: under DDP each holds its own rows' loss and this is a collective; under
        # SPMD the loss is already the global one and this does nothing
        loss = trainer.strategy.reduce(pl_module.last_loss, reduce_op="mean")
        if not trainer.is_global_zero:
            return
        now = time.perf_counter()
        opt = pl_module.optimizers().optimizer
        # the one device-to-host transfer of this logging interval
        loss, lr_mult = self.fetch([loss, opt.last_lr_multiplier()])
        tok_per_s = (step - self._step0) * self.tokens_per_step / max(now - self._t0, 1e-9)
        self._t0, self._step0 = now, step
        lr = float(f"{opt.param_groups[0]['lr'] * lr_mult:.6g}")
        record = {"step": step, "loss": round(loss, 6), "lr": lr,
                  "tokens": step * self.tokens_per_step, "tok_per_s": round(tok_per_s, 1),
                  "tok_per_s_per_chip": round(tok_per_s / self.chips, 1)}
        if self.peak_flops and self.flops_per_token:
            record["mfu"] = round(tok_per_s * self.flops_per_token / (self.peak_flops * self.chips), 5)
        record.update(self.extra())
        self.write(record)

    def on_validation_epoch_end(self, trainer, pl_module):
        if trainer.sanity_checking:
            return
        summary = pl_module.validation_summary()  # every process (a collective under DDP)
        if not trainer.is_global_zero:
            return
        self.write({"step": trainer.global_step, **{k: round(v, 6) for k, v in summary.items()}})
        self._t0 = time.perf_counter()  # do not charge evaluation time to training throughput

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()
