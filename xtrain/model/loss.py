"""The training loss: logit softcap and cross-entropy as one fused step.

``cap * tanh(z / cap)``, log-softmax and the negative log-likelihood written as separate torch
ops keep several logits-sized float32 buffers alive (the tanh output and the log-probabilities
for backward, plus each op's output), and run as one pass over memory per op. Here the forward
computes only the loss and the row log-sum-exp, saving the raw logits it was given; the backward
recomputes the softcap and writes the gradient in one pass. The work runs in slices along the
sequence, so the float32 temporaries are one slice in size: beyond the logits themselves, the
gradient is the only logits-sized buffer.

Slices run along the sequence (dim 1) rather than over flattened rows, so each slice keeps the
batch's layout. The XLA engine keeps the unfused ops (see ``softcap_cross_entropy``).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

# float32 elements per slice (16 MiB), and at most this many slices (each slice is another copy
# of a few ops in a traced XLA graph)
SLICE_ELEMENTS = 1 << 22
MAX_SLICES = 8


def softcap(logits, cap: float):
    return cap * torch.tanh(logits / cap)


def _slices(logits) -> list[tuple[int, int]]:
    T = logits.size(1)
    n = max(1, min(MAX_SLICES, T, math.ceil(logits.numel() / SLICE_ELEMENTS)))
    size = math.ceil(T / n)
    return [(t0, min(t0 + size, T)) for t0 in range(0, T, size)]


class _SoftcapCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, cap: float):
        valid = targets >= 0
        count = valid.sum().clamp(min=1).float()
        total = logits.new_zeros((), dtype=torch.float32)
        lse_parts = []
        for t0, t1 in _slices(logits):
            capped = softcap(logits[:, t0:t1].float(), cap)
            lse = torch.logsumexp(capped, dim=-1)
            picked = capped.gather(-1, targets[:, t0:t1].clamp(min=0).unsqueeze(-1)).squeeze(-1)
            total = total + ((lse - picked) * valid[:, t0:t1]).sum()
            lse_parts.append(lse)
        ctx.save_for_backward(logits, targets, torch.cat(lse_parts, dim=1), count)
        ctx.cap = cap
        return total / count

    @staticmethod
    def backward(ctx, grad_loss):
        logits, targets, lse, count = ctx.saved_tensors
        cap = ctx.cap
        grad = torch.empty_like(logits)
        scale = grad_loss / count
        for t0, t1 in _slices(logits):
            tanh = torch.tanh(logits[:, t0:t1].float() / cap)
            # d loss / d capped = softmax - onehot(target), for scored positions only
            probs = torch.exp(cap * tanh - lse[:, t0:t1, None])
            target = targets[:, t0:t1]
            index = target.clamp(min=0).unsqueeze(-1)
            probs.scatter_add_(-1, index, torch.full(index.shape, -1.0, dtype=probs.dtype,
                                                     device=probs.device))
            weight = (target >= 0).to(probs.dtype) * scale
            # d capped / d logits = 1 - tanh^2
            grad[:, t0:t1] = (probs * (1 - tanh * tanh) * weight[..., None]).to(grad.dtype)
        return grad, None, None


def softcap_cross_entropy(logits, targets, cap: float):
    """Mean cross-entropy of ``softcap(logits)`` [B, T, V] against ``targets`` [B, T]; a target
    of -1 is not scored (``F.cross_entropy``'s ``ignore_index=-1`` and mean reduction).

    On the XLA engine the plain ops: the compiler fuses the chain itself, and the sliced form
    crashed torch_xla 2.9.0's SPMD partitioner ("Check failed: ShapeUtil::IsScalarWithElementType",
    tests/test_xla.py's recompilation-guard run, one row over a data axis of 2)."""
    if logits.device.type != "cpu":
        return F.cross_entropy(softcap(logits.float(), cap).flatten(0, 1), targets.reshape(-1),
                               ignore_index=-1)
    return _SoftcapCrossEntropy.apply(logits, targets, cap)
