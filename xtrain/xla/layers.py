"""How the transformer blocks run on the XLA engine: scanned (one compiled body looped over the
stacked weights) or unrolled, with or without activation checkpointing per block.

Unrolled, the compiled step holds ``depth`` copies of the block's forward and backward; the TPU
compiler's time grows with it (BENCHMARKS.md, "TPU compile": 231 s unrolled vs 102 s scanned
for v6e4 d16 2048 x 8).
Scanned, it holds one: torch_xla's ``scan`` traces the block once with AOTAutograd into a forward
and a backward graph and runs each in an XLA ``While`` loop over the layers.

The parameters stay the model's own (``blocks.<i>.*``, so checkpoints do not depend on the
option): each step stacks them per name into ``[depth, ...]`` tensors inside the graph (XLA turns
the stack into in-place slices) and autograd hands each layer's slice of the stacked gradient
back to its parameter. Each stack is sharded like its layers' parameters (the parallelism rules,
with the layer dimension unsharded), so FSDP still gathers one layer's weights at a time.

Windowed layers differ from full ones (the attention kernel and mask are part of the body), so
a window pattern is scanned a period at a time: the body runs ``len(pattern)`` blocks; layers
after the last whole period (the last layer is always full) run unrolled after the scan.

Activation checkpointing inside the scan: the partitioner that splits the traced block into
forward and backward graphs is told to recompute every forward value, so the forward saves
only the block's inputs; unrolled, torch_xla's checkpoint (with its optimization barrier,
without which XLA's CSE would undo the recomputation) wraps each block.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from xtrain import compat
from xtrain.errors import ConfigError
from xtrain.model.config import scan_period
from xtrain.model.gpt import GPT
from xtrain.xla.spmd import mark, micro_batch_fence


class _Period(nn.Module):
    """One scan step: the blocks of one period of the window pattern, run in order."""

    def __init__(self, blocks):
        super().__init__()
        self.blocks = nn.ModuleList(blocks)

    def forward(self, x, cos, sin):
        for block in self.blocks:
            x = block(x, cos, sin)
        return x


class _Body:
    """The scanned function: (x, (this step's weights, cos, sin)) -> (x, nothing). The template's
    own parameters are swapped for the step's slices of the stacks (``functional_call``)."""

    def __init__(self, template: _Period):
        self.template = template

    def __call__(self, x, xs):
        params, cos, sin = xs
        return torch.func.functional_call(self.template, params, (x, cos, sin), strict=True), None


class ScannedBlocks:
    """``model.layer_loop`` for scan: (x, cos, sin) -> x, over ``model.blocks``."""

    def __init__(self, model: GPT, param_specs: dict | None, mesh, remat: bool):
        self.model, self.mesh, self.remat = model, mesh, remat
        self.period, self.repeats = scan_period(model.config.windows)
        if self.repeats < 2:
            raise ConfigError(f"model.scan: the window pattern {model.config.windows} has no "
                              "period that repeats over the layers; set model.scan=false")
        self.stack_specs = self._stack_specs(param_specs or {})
        self._body = None  # traced once (torch_xla caches the traced graphs per body object)
        self._fenced: list = []  # what the step's fence handed over, barriered at the next scan

    def fence(self, tensors) -> None:
        """The micro-batch fence of a step with scanned blocks (xtrain/xla/spmd.py step_fence):
        the barrier over ``tensors`` (a micro-batch's inputs and the gradients so far) is put off
        to the micro-batch's scan, where the rotary tables the scan reads join it, so the scan's
        loop cannot start before the previous backward is done.

        Why there: torch_xla's scan lowers its backward body together with everything the
        scan's carry and weights are computed from (in SPMD the body ties their shardings to
        their gradients'). With the barrier upstream of the carry, its operands, every earlier
        micro-batch, were copied into each later body (the d16 step: 379,497 StableHLO ops
        instead of 15,530). The rotary tables get no gradient, so no body reaches them."""
        self._fenced = list(tensors)

    def _names(self, period_index: int):
        for i in range(self.period):
            layer = period_index * self.period + i
            for name, _ in self.model.blocks[layer].named_parameters():
                yield f"blocks.{i}.{name}", f"blocks.{layer}.{name}"

    def _stack_specs(self, param_specs: dict) -> dict:
        """stacked name -> spec: the layers' common spec with the layer dimension unsharded."""
        specs = {}
        for k in range(self.repeats):
            for stacked, name in self._names(k):
                spec = param_specs.get(name)
                if stacked in specs and specs[stacked] != spec:
                    raise ConfigError(f"model.scan stacks {name} with the same parameter of other "
                                      f"layers, but the parallelism rules shard it as {spec}, not "
                                      f"{specs[stacked]}: give every layer the same rule, or set "
                                      "model.scan=false")
                specs[stacked] = spec
        return specs

    def _stacked_params(self) -> dict:
        params = dict(self.model.named_parameters())
        stacks = {}
        for stacked, spec in self.stack_specs.items():
            _, i, rest = stacked.split(".", 2)
            layers = [params[f"blocks.{k * self.period + int(i)}.{rest}"] for k in range(self.repeats)]
            t = torch.stack(layers)
            if self.mesh is not None:
                mark(t, self.mesh, (None, *spec) if spec is not None else None)
            stacks[stacked] = t
        return stacks

    def __call__(self, x, cos, sin):
        from functorch.compile import min_cut_rematerialization_partition
        from torch_xla.experimental.scan import scan

        blocks = self.model.blocks
        if self._fenced:
            # copies: the barrier rewrites its operands in place, and these are views of the
            # model's buffers
            cos, sin = cos.clone(), sin.clone()
            micro_batch_fence([cos, sin, *self._fenced])
            self._fenced = []
        if self._body is None:
            self._body = _Body(_Period([blocks[i] for i in range(self.period)]))
        # the rotary tables ride along as scanned inputs (a broadcast, not copies): closed over,
        # they would become constants of the traced body
        rope = tuple(t.expand(self.repeats, *t.shape) for t in (cos, sin))
        partition = compat.remat_partition if self.remat else min_cut_rematerialization_partition
        x, _ = scan(self._body, x, (self._stacked_params(), *rope), partition_fn=partition,
                    is_fn_pure=True)
        # the layers after the last whole period (SSSL over 26 layers: 2), one by one
        return run_unrolled(list(blocks)[self.period * self.repeats:], x, cos, sin, self.remat)


def run_unrolled(blocks, x, cos, sin, remat: bool):
    """``blocks`` one after the other; with ``remat`` (and grad) each checkpointed: only its
    input kept, its activations recomputed in backward."""
    from torch_xla.utils.checkpoint import checkpoint

    for block in blocks:
        x = checkpoint(block, x, cos, sin) if remat and torch.is_grad_enabled() else \
            block(x, cos, sin)
    return x


class CheckpointedBlocks:
    """``model.layer_loop`` for unrolled blocks with activation checkpointing per block."""

    def __init__(self, model: GPT):
        self.model = model

    def __call__(self, x, cos, sin):
        return run_unrolled(self.model.blocks, x, cos, sin, remat=True)


def install_layer_loop(model: GPT, param_specs: dict | None, mesh) -> None:
    """Set how ``model`` runs its blocks on the XLA engine, from its config (scan, remat)."""
    config = model.config
    if config.scan:
        model.layer_loop = ScannedBlocks(model, param_specs, mesh, config.remat)
    elif config.remat:
        model.layer_loop = CheckpointedBlocks(model)
    else:
        model.layer_loop = None
