"""The LightningModule: one training batch is one optimizer step.

A batch is ``(tokens [B, A, T+1], loader_state)``: this process's ``B`` rows of all ``A``
gradient-accumulation micro-batches of the step, fetched outside the step, plus the loader position after them (checkpointed, so resume
is exact even though Lightning prefetches a batch ahead). Optimisation is manual so the whole step
(xtrain/engines/step.py) sits inside one ``optimizer.step(closure)`` call, which the XLA engine
compiles as one graph.
"""

from __future__ import annotations

import math

import lightning as L
import torch

from xtrain.engines.step import autocast, split_inputs_targets, step_closure
from xtrain.model.config import GPTConfig
from xtrain.model.gpt import GPT
from xtrain.optim import build_optimizer


class GPTModule(L.LightningModule):
    def __init__(self, gpt_config: GPTConfig, optim, max_steps: int, precision: str = "float32",
                 token_bytes=None):
        super().__init__()
        self.automatic_optimization = False
        self.model = GPT(gpt_config)
        self.optim_cfg, self.max_steps, self.precision_name = optim, max_steps, precision
        # bytes each target token stands for (bits-per-byte); a buffer so it moves with the model
        tb = torch.as_tensor(token_bytes if token_bytes is not None else [], dtype=torch.float32)
        self.register_buffer("token_bytes", tb, persistent=False)
        # device tensors of the last step (loss, grad_norm); the metrics callback reads them
        # at logging steps only
        self.last_loss = None
        self.step_stats: dict = {}
        self._val_sums = None

    def configure_optimizers(self):
        return build_optimizer(self.model, self.optim_cfg, self.max_steps, self.precision_name)

    def training_step(self, batch, batch_idx):
        tokens, _ = batch
        opt = self.optimizers()
        closure = step_closure(self.model, tokens, self.manual_backward, self.optim_cfg.grad_clip,
                               self.precision_name, stats=self.step_stats, fence=self.fence(tokens))
        loss = opt.step(closure=closure)
        opt.zero_grad(set_to_none=True)
        self.last_loss = loss

    def fence(self, tokens):
        """What orders the micro-batches of a compiled step (XLA), or None (eager: in order)."""
        if tokens.device.type != "xla":
            return None
        from xtrain.xla.spmd import step_fence

        return step_fence(self.model)

    # --- validation: loss and bits per byte --------------------------------------------------
    def on_validation_start(self):
        # nats, tokens, bytes; uploaded rather than created on device, so under XLA every
        # validation batch traces the same graph
        self._val_sums = torch.zeros(3).to(self.device)

    def validation_step(self, batch, batch_idx):
        x, y = split_inputs_targets(batch)
        with autocast(x.device.type, self.precision_name):
            logits = self.model(x)
        nats = torch.nn.functional.cross_entropy(
            logits.float().reshape(-1, logits.size(-1)), y.reshape(-1), reduction="none", ignore_index=-1)
        y = y.reshape(-1)
        nbytes = torch.where(y >= 0, self.token_bytes[y.clamp(min=0)], 0.0)
        counted = nbytes > 0  # BOS and PAD stand for no bytes: excluded, as nanochat does
        self._val_sums += torch.stack([(nats * counted).sum(), counted.sum(), nbytes.sum()])

    def validation_summary(self) -> dict:
        """Host read of the validation sums; called once per evaluation, on every process (each
        holds its own rows' sums under DDP)."""
        sums = self.trainer.strategy.reduce(self._val_sums, reduce_op="sum")
        nats, count, nbytes = sums.tolist()
        return {"val_loss": nats / max(count, 1), "val_bpb": nats / (math.log(2) * max(nbytes, 1))}
