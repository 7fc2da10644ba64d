"""The training loss: the head's matmul, the logit softcap and cross-entropy as one fused step.

Written as separate ops (``lm_head``, ``cap * tanh(z / cap)``, log-softmax, the negative
log-likelihood) the chain keeps several logits-sized float32 buffers alive (the logits, the tanh
output and the log-probabilities for backward, each op's output) and makes a pass over memory
per op; its backward computes the tanh and the exponentials again. On CPU it is the largest cost
outside the matmuls. Here the head runs a slice of rows at a time, and each slice's logits,
while at hand, give both that slice's loss and its gradient (the loss is the graph's end, so the
gradient of the logits needs nothing from later): no logits-sized buffer at all, and the
backward only scales the gradients the forward computed.

The XLA engine keeps the unfused ops (see :func:`softcap_cross_entropy`).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

# float32 logits per slice (8 MiB) and at most this many slices (each is another copy of the
# ops in a compiled graph)
SLICE_ELEMENTS = 1 << 21
MAX_SLICES = 16
# Up to this cap the log-sum-exp needs no pass for the row maximum: capped logits lie in
# [-cap, cap], so exp(capped - cap) lies in [exp(-2 cap), 1], a normal float32 (>= 1.2e-38) for
# cap <= 43, and a row's sum stays below the vocabulary size.
FIXED_SHIFT_MAX_CAP = 40.0


def softcap(logits, cap: float):
    return cap * torch.tanh(logits / cap)


def _row_slices(rows: int, vocab: int) -> list[tuple[int, int]]:
    n = max(1, min(MAX_SLICES, rows, math.ceil(rows * vocab / SLICE_ELEMENTS)))
    size = math.ceil(rows / n)
    return [(r0, min(r0 + size, rows)) for r0 in range(0, rows, size)]


def _logistic(x):
    """``sigmoid(x)`` and its derivative ``sigmoid(x) * sigmoid(-x)`` (``1 - sigmoid(x)`` would
    cancel where x is large).

    The loss computes its softcap through it: ``cap * tanh(z / cap) = cap - 2 cap s`` with
    ``s = sigmoid(-2 z / cap)``, whose derivative ``1 - tanh^2`` is ``4 s (1 - s)``. Measured when
    this was written, on one 512-row slice of the cpu_peer bench's head (vocabulary 4096), the
    slice's elementwise chain costs 0.4x the tanh form compiled (inductor's vectorised tanh is
    slow) and 0.7x eager."""
    s = torch.sigmoid(x)
    return s, s * torch.sigmoid(-x)


class _HeadSoftcapCrossEntropy(torch.autograd.Function):
    """hidden [N, D], head weight [V, D], targets [N] -> the summed loss of the scored rows
    (target >= 0) over their count; gradients computed in the forward."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, cap: float):
        scored = targets >= 0
        count = scored.sum().clamp(min=1).float()
        total = hidden.new_zeros((), dtype=torch.float32)
        grad_hidden = torch.empty_like(hidden)
        grad_weight = torch.zeros_like(weight)
        vocab_ids = torch.arange(weight.size(0), device=hidden.device, dtype=torch.int32)
        for r0, r1 in _row_slices(hidden.size(0), weight.size(0)):
            rows, target, keep = hidden[r0:r1], targets[r0:r1, None], scored[r0:r1, None].float()
            s, slope = _logistic((rows @ weight.t()).float() * (-2 / cap))
            if cap <= FIXED_SHIFT_MAX_CAP:
                shift, exp = cap, torch.exp(s * (-2 * cap))  # exp(capped - cap)
            else:
                capped = cap - 2 * cap * s
                shift = capped.amax(-1, keepdim=True)
                exp = torch.exp(capped - shift)
            row_sum = exp.sum(-1, keepdim=True)
            picked = cap - 2 * cap * s.gather(-1, target.clamp(min=0))
            total = total + ((shift + torch.log(row_sum) - picked) * keep).sum()
            # d loss / d capped = softmax - onehot(target)
            grad_capped = exp * (keep / row_sum) - (vocab_ids == target.int()) * keep
            grad_logits = (grad_capped * (4 * slope)).to(weight.dtype)
            grad_hidden[r0:r1] = grad_logits @ weight
            grad_weight.addmm_(grad_logits.t(), rows)
        ctx.save_for_backward(grad_hidden, grad_weight, count)
        return total / count

    @staticmethod
    def backward(ctx, grad_loss):
        grad_hidden, grad_weight, count = ctx.saved_tensors
        scale = grad_loss / count
        return grad_hidden * scale, grad_weight * scale, None, None


def softcap_cross_entropy(hidden, weight, targets, cap: float):
    """Mean cross-entropy of ``softcap(hidden @ weight.T)`` (hidden [B, T, D], the head's weight
    [V, D]) against ``targets`` [B, T]; a target of -1 is not scored (``F.cross_entropy``'s
    ``ignore_index=-1`` and mean reduction). For training: on CPU its forward also computes the
    gradients (validation scores logits instead).

    On the XLA engine the plain ops: the compiler fuses the chain itself, and a sliced form
    crashed torch_xla 2.9.0's SPMD partitioner ("Check failed: ShapeUtil::IsScalarWithElementType",
    tests/test_xla.py's recompilation-guard run, one row over a data axis of 2)."""
    if hidden.device.type != "cpu":
        logits = F.linear(hidden, weight)
        return F.cross_entropy(softcap(logits.float(), cap).flatten(0, 1), targets.reshape(-1),
                               ignore_index=-1)
    return _HeadSoftcapCrossEntropy.apply(hidden.flatten(0, 1), weight, targets.reshape(-1), cap)
