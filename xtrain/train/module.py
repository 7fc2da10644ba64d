"""The LightningModule: one training batch is one optimizer step.

A batch is ``(tokens [A, B, T+1], loader_state)``: all ``A`` gradient-accumulation micro-batches of
the step, fetched outside the step, plus the loader position after them (checkpointed, so resume
is exact even though Lightning prefetches a batch ahead). Optimisation is manual so the whole step
(every micro-batch's forward and backward, clipping, the update) sits inside one
``optimizer.step(closure)`` call, which the XLA engine compiles as one graph.
"""

from __future__ import annotations

import math
from contextlib import nullcontext

import lightning as L
import torch

from xtrain.model.gpt import GPT, GPTConfig
from xtrain.train.optim import build_optimizer


def split_inputs_targets(tokens):
    """[B, T+1] -> inputs [B, T], targets [B, T]. PAD (-1, see the loader) is an ignored target;
    as an input it is clamped to a real id (its output is never scored)."""
    tokens = tokens.long()
    return tokens[:, :-1].clamp(min=0), tokens[:, 1:]


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
        self.last_loss = None  # device tensor; read by the metrics callback at log steps only
        self._val_sums = None

    def configure_optimizers(self):
        return build_optimizer(self.model, self.optim_cfg, self.max_steps, self.precision_name)

    def _autocast(self, device_type: str):
        if self.precision_name == "bfloat16":
            return torch.autocast(device_type, dtype=torch.bfloat16)
        return nullcontext()

    def step_closure(self, tokens, backward):
        """The body of one optimizer step over ``tokens`` [A, B, T+1]: every micro-batch's forward
        and ``backward``, then clipping; returns the mean loss. Training runs it through
        ``optimizer.step(closure)``; the TPU preflight traces the very same function."""
        accum = tokens.size(0)

        def closure():
            total = torch.zeros((), device=tokens.device)
            for micro in tokens.unbind(0):
                x, y = split_inputs_targets(micro)
                with self._autocast(tokens.device.type):
                    loss = self.model(x, y) / accum
                backward(loss)
                total = total + loss.detach()
            if self.optim_cfg.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.optim_cfg.grad_clip)
            return total

        return closure

    def training_step(self, batch, batch_idx):
        tokens, _ = batch
        opt = self.optimizers()
        loss = opt.step(closure=self.step_closure(tokens, self.manual_backward))
        opt.zero_grad(set_to_none=True)
        self.last_loss = loss

    # --- validation: loss and bits per byte --------------------------------------------------
    def on_validation_start(self):
        # nats, tokens, bytes; uploaded rather than created on device, so under XLA every
        # validation batch traces the same graph
        self._val_sums = torch.zeros(3).to(self.device)

    def validation_step(self, batch, batch_idx):
        x, y = split_inputs_targets(batch)
        with self._autocast(x.device.type):
            logits = self.model(x)
        nats = torch.nn.functional.cross_entropy(
            logits.float().reshape(-1, logits.size(-1)), y.reshape(-1), reduction="none", ignore_index=-1)
        y = y.reshape(-1)
        nbytes = torch.where(y >= 0, self.token_bytes[y.clamp(min=0)], 0.0)
        counted = nbytes > 0  # BOS and PAD stand for no bytes: excluded, as nanochat does
        self._val_sums += torch.stack([(nats * counted).sum(), counted.sum(), nbytes.sum()])

    def validation_summary(self) -> dict:
        """Host read of the validation sums; called once per evaluation."""
        nats, count, nbytes = self._val_sums.tolist()
        return {"val_loss": nats / max(count, 1), "val_bpb": nats / (math.log(2) * max(nbytes, 1))}
