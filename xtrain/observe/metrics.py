"""Per-step metrics: ``metrics.jsonl`` in the run dir, the console, and W&B when enabled.

Values are read from the device only every ``log_every`` steps (and at evaluations), so logging
adds no host sync to the other steps. Lightning's progress bar is disabled for the same reason.
"""

from __future__ import annotations

import json
import os
import threading
import time

import lightning as L


class MetricsLogger(L.Callback):
    def __init__(self, path: str, log_every: int, tokens_per_step: int, flops_per_token: float = 0.0,
                 peak_flops: float = 0.0, chips: int = 1, wandb_run=None, extra=None, fetch=None):
        self.path, self.log_every, self.tokens_per_step = path, log_every, tokens_per_step
        self.flops_per_token, self.peak_flops, self.chips = flops_per_token, peak_flops, chips
        self.wandb_run = wandb_run
        self.extra = extra or (lambda: {})  # engine-specific counters (e.g. XLA compiles)
        # device tensors -> Python floats in one transfer (the engine knows how)
        self.fetch = fetch or (lambda tensors: [float(t) for t in tensors])
        self._t0 = None
        self._step0 = 0
        self._lock = threading.Lock()

    def write(self, record: dict) -> None:
        """Append one record; thread-safe (checkpoint uploads report from their own thread)."""
        with self._lock, open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        if self.wandb_run is not None:
            self.wandb_run.log({k: v for k, v in record.items() if k != "step"}, step=record["step"])

    def on_train_start(self, trainer, pl_module):
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        self._t0, self._step0 = time.perf_counter(), trainer.global_step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        step = trainer.global_step
        if step % self.log_every and step not in (1, trainer.max_steps):
            return
        if trainer.global_rank != 0:
            return
        now = time.perf_counter()
        opt = pl_module.optimizers().optimizer
        # the one device-to-host transfer of this logging interval
        loss, lr_mult = self.fetch([pl_module.last_loss, opt.last_lr_multiplier()])
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
        print(f"step {step:6d}/{trainer.max_steps} | loss {loss:.4f} | lr {record['lr']:.2e} | "
              f"{tok_per_s:,.0f} tok/s" + (f" | mfu {record['mfu']:.1%}" if "mfu" in record else ""),
              flush=True)

    def on_validation_epoch_end(self, trainer, pl_module):
        if trainer.sanity_checking or trainer.global_rank != 0:
            return
        summary = pl_module.validation_summary()
        self.write({"step": trainer.global_step, **{k: round(v, 6) for k, v in summary.items()}})
        print(f"step {trainer.global_step:6d} | val loss {summary['val_loss']:.4f} | "
              f"val bpb {summary['val_bpb']:.4f}", flush=True)
        self._t0 = time.perf_counter()  # do not charge evaluation time to training throughput
