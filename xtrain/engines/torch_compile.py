"""``trainer.compile`` on the CPU engine: the model's forward+backward and the optimizer update
compiled by ``torch.compile`` (inductor).

Why compile on CPU: outside the matrix multiplies a step is chains of small elementwise ops
(rotary, relu^2, RMSNorm, the softcap and loss, the Muon update), each a separate pass over
memory in eager mode; inductor fuses them into a few loops. Compiled code is cached in
``<cache root>/inductor`` (inductor's FX-graph and AOTAutograd caches), so a relaunched run
skips most of the first-step compile.

Compiled runs are bitwise repeatable, as eager ones are (so a resumed run continues exactly):
inductor would lower the embedding's backward, a scatter-add over repeated token ids, to a
parallel loop of atomic adds whose order changes from run to run; torch's deterministic mode
makes it call aten's serial CPU kernel instead (:func:`deterministic_kernels`).
"""

from __future__ import annotations

import os
import time

import lightning as L

from xtrain import compat
from xtrain.paths import cache_root


def use_inductor_cache() -> str:
    """Point inductor's on-disk caches at xtrain's cache root (an explicit
    TORCHINDUCTOR_CACHE_DIR wins); inductor reads the variable whenever it looks for the cache."""
    return os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_root() / "inductor"))


def deterministic_kernels() -> tuple[bool, bool]:
    """Turn on torch's deterministic mode (inductor then lowers scatter-adds to aten's serial
    kernel) without its filling of new buffers (time spent, nothing gained: every buffer here is
    written before it is read); returns the previous settings for :func:`restore_kernels`."""
    import torch

    previous = (torch.are_deterministic_algorithms_enabled(), torch.utils.deterministic.fill_uninitialized_memory)
    torch.use_deterministic_algorithms(True)
    torch.utils.deterministic.fill_uninitialized_memory = False
    return previous


def restore_kernels(previous: tuple[bool, bool]) -> None:
    import torch

    torch.use_deterministic_algorithms(previous[0])
    torch.utils.deterministic.fill_uninitialized_memory = previous[1]


def compile_fn():
    import torch

    return torch.compile


def loss_compiled(eager_forward, compile_):
    """The model's forward, compiled for the training loss only (calls with ``targets``;
    validation computes its own loss from the eager logits): generation
    (samples, the C++ evaluation) calls it with a KV cache at every length, which would compile
    a graph per length."""
    compiled = compile_(eager_forward)

    def forward(idx, targets=None, kv_cache=None):
        if targets is not None and kv_cache is None:
            return compiled(idx, targets)
        return eager_forward(idx, targets, kv_cache)

    return forward


class TorchCompile(L.Callback):
    """Compiles the model's forward (the loss and, through AOTAutograd, its backward) and the
    optimizer update when training starts, after a checkpoint was restored (so the compiled
    update sees the restored state tensors); the model runs eagerly again when training ends
    (end-of-run sampling calls it at every length). Prints the first step's time, compile
    included."""

    def __init__(self):
        self.t0 = None
        self.first_step_s = None
        self.previous_kernels = None
        self.cache_lookups_before = (0, 0)  # a sweep's jobs share a process, and its counters

    def on_train_start(self, trainer, pl_module) -> None:
        cache = use_inductor_cache()
        self.cache_lookups_before = compat.inductor_cache_lookups()
        self.previous_kernels = deterministic_kernels()  # before anything compiles: inductor reads it
        compile_ = compile_fn()
        model = pl_module.model
        model.forward = loss_compiled(model.forward, compile_)  # instance attribute: keys unchanged
        for opt in trainer.optimizers:
            opt.compile_update(compile_)
        print(f"torch.compile: model forward+backward and optimizer update (cache {cache})", flush=True)

    def on_train_batch_start(self, trainer, *args) -> None:
        if self.first_step_s is None:
            self.t0 = time.perf_counter()

    def on_train_batch_end(self, trainer, *args) -> None:
        if self.first_step_s is None:
            self.first_step_s = time.perf_counter() - self.t0
            hits, lookups = (now - before for now, before in zip(compat.inductor_cache_lookups(),
                                                                  self.cache_lookups_before))
            print(f"torch.compile: first step {self.first_step_s:.1f} s (compiling included; "
                  f"{hits} of {lookups} graphs from the cache)", flush=True)

    def on_train_end(self, trainer, pl_module) -> None:
        pl_module.model.__dict__.pop("forward", None)  # back to the class's (eager) forward
        for opt in trainer.optimizers:
            opt.__dict__.pop("update", None)
        restore_kernels(self.previous_kernels)


def compile_pays(plan) -> bool:
    """Whether ``trainer.compile`` defaults to on: where the fused elementwise work outweighs
    the first step's compile (measured in BENCHMARKS.md, cpu_peer)."""
    return plan.gpt.n_embd >= 256 and plan.gpt.sequence_len >= 512
