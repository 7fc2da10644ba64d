"""One optimizer step's body, in torch only: what training runs and the TPU preflight traces.

A step takes ``tokens [B, A, T+1]``: ``B`` rows of all ``A`` gradient-accumulation micro-batches,
fetched outside the step, so the XLA engine compiles the whole step (every micro-batch's forward
and backward, clipping, the optimizer update) as one graph. Rows come first because torch_xla's
per-host input sharding splits dim 0 (xtrain/xla/spmd.py).
"""

from __future__ import annotations

from contextlib import nullcontext

import torch


def split_inputs_targets(tokens):
    """[B, T+1] -> inputs [B, T], targets [B, T]. PAD (-1, see the loader) is an ignored target;
    as an input it is clamped to a real id (its output is never scored)."""
    tokens = tokens.long()
    return tokens[:, :-1].clamp(min=0), tokens[:, 1:]


def autocast(device_type: str, precision: str):
    """Matmuls in bfloat16 on bfloat16 profiles (weights stay float32); nothing otherwise."""
    if precision == "bfloat16":
        return torch.autocast(device_type, dtype=torch.bfloat16)
    return nullcontext()


def step_closure(model, tokens, backward, grad_clip: float, precision: str, stats: dict | None = None,
                 fence=None):
    """The closure ``optimizer.step(closure)`` runs: every micro-batch's forward and ``backward``
    (``loss.backward`` or Lightning's ``manual_backward``), then gradient clipping; it returns
    the mean loss as a device tensor. ``stats["grad_norm"]`` receives the global gradient norm
    before clipping, a device tensor of the same graph (read only when the run logs).

    ``fence(tensors)``: called before each micro-batch after the first with its inputs and the
    gradients so far; the XLA engine passes an optimization barrier (xtrain/xla/spmd.py), so a
    micro-batch's forward cannot start before the previous backward is done. Without it the TPU
    compiler overlapped the micro-batches of one graph and kept all their activations alive at
    once (temporaries grew with the number of micro-batches: BENCHMARKS.md, "TPU compile"). With
    scanned blocks the barrier is placed at the micro-batch's scan instead (xtrain/xla/layers.py
    ``ScannedBlocks.fence``)."""
    accum = tokens.size(1)

    def closure():
        total = torch.zeros((), device=tokens.device)
        for i, micro in enumerate(tokens.unbind(1)):
            x, y = split_inputs_targets(micro)
            if fence is not None and i > 0:
                fence([x, y] + [p.grad for p in model.parameters() if p.grad is not None])
            with autocast(tokens.device.type, precision):
                loss = model(x, y) / accum
            backward(loss)
            total = total + loss.detach()
        if grad_clip > 0:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        else:
            norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None])
        if stats is not None:
            stats["grad_norm"] = norm
        return total

    return closure
