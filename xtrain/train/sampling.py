"""Text samples during and at the end of training: every ``trainer.sample_every`` steps and after
the last step, from the fixed prompts of the ``sample`` config, on rank 0, outside the compiled
step (the XLA engine's model is copied to the CPU first), logged as ``sample`` records."""

from __future__ import annotations

import logging

import lightning as L
import torch

from xtrain.config import sample_prompts
from xtrain.model.generate import check_prompts_fit, generate
from xtrain.model.gpt import GPT
from xtrain.xla.spmd import full_cpu_tensors

log = logging.getLogger(__name__)


def host_copy(model):
    """The model on the CPU, copied from this host's shards without compiling anything (a sharded
    tensor's own ``.cpu()`` compiles a gather per tensor). Generating on an XLA device would trace
    and compile a graph per sequence length; on the CPU the model is used as it is."""
    if next(model.parameters()).device.type != "xla":
        return model
    return GPT.from_weights(model.config, full_cpu_tensors(model.state_dict()))


def host_copy_or_none(model, skipped: str):
    """:func:`host_copy`, or None (with a warning naming what is ``skipped``) on a pod host,
    which holds only its shards of the weights."""
    try:
        return host_copy(model)
    except RuntimeError as e:
        log.warning("%s skipped for the rest of the run: %s", skipped, e)
        return None


def check_prompts_room(cfg, tokenizer, sequence_len: int, rank: int) -> None:
    """Refuse a training whose sample prompts, or its C++ evaluation's, leave no room in the
    model's context for the tokens generated after them: as soon as the tokenizer that counts
    them is known (a corpus build makes it), before the loaders, the model or a checkpoint. The
    evaluation's problems are read where it runs: by process 0."""
    if cfg.trainer.sample_tokens > 0:
        check_prompts_fit(tokenizer, sample_prompts(cfg.sample), cfg.trainer.sample_tokens,
                          sequence_len, "trainer.sample_tokens")
    if cfg.eval.cpp_every and rank == 0:
        from xtrain.evals.completions import check_fit
        from xtrain.evals.problems import load_problems

        check_fit(tokenizer, load_problems(cfg.eval.cpp_file), cfg.eval, sequence_len)


class SampleCallback(L.Callback):
    """``tokens`` per sample (none without prompts); ``every`` steps between samples (0: only at
    the end); the same seed every time, so samples of one run differ only by what the model
    learnt. ``stop``: the run's StopRequest (xtrain/train/preemption.py): a stop requested calls
    a sample off (:meth:`sample_unless_stopping`)."""

    def __init__(self, tokenizer, sample_cfg, tokens: int, every: int, run_log, timer, stop=None):
        self.prompts = sample_prompts(sample_cfg)  # (checked to fit: check_prompts_room)
        self.tokenizer, self.cfg, self.every = tokenizer, sample_cfg, every
        self.tokens = tokens if self.prompts else 0  # sample.prompts=[]: no samples in training
        self.run_log, self.timer, self.stop = run_log, timer, stop

    def sample(self, step: int, model) -> dict | None:
        with self.timer.measure("sample"):  # not charged to training throughput
            was_training = model.training
            stats = {}
            prompts = self.prompts
            cpu_model = host_copy_or_none(model, "samples")
            if cpu_model is None:
                self.tokens = 0
                return None
            if not all(torch.isfinite(p).all() for p in cpu_model.parameters()):
                # (sampling would fail on NaN probabilities; recorded, so a resumed end is done)
                model.train(was_training)
                return self.run_log.record("sample", step, {"samples": [],
                                                            "skipped": "the weights hold NaN or inf"})
            texts = generate(cpu_model, self.tokenizer, prompts, 1, max_tokens=self.tokens,
                             temperature=self.cfg.temperature, top_k=self.cfg.top_k,
                             seed=self.cfg.seed, stats=stats)
            model.train(was_training)
        samples = [{"prompt": p, "text": t[0]} for p, t in zip(prompts, texts)]
        return self.run_log.record("sample", step, {
            "samples": samples, "sample_tok_per_s": round(stats["tokens"] / max(stats["seconds"], 1e-9), 1)})

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        step = trainer.global_step
        if (self.every and step % self.every == 0 and step != trainer.max_steps
                and trainer.global_rank == 0 and self.tokens > 0):
            self.sample_unless_stopping(step, pl_module.model)

    def on_train_end(self, trainer, pl_module):
        if trainer.global_rank == 0 and self.tokens > 0:
            self.sample_unless_stopping(trainer.global_step, pl_module.model)

    def sample_unless_stopping(self, step: int, model) -> dict | None:
        """A step's sample (here, or one a resumed run makes up: xtrain/train/catch_up.py), unless
        a stop was requested: on a TPU host it gathers every weight and generates on the CPU,
        which a preemption notice leaves no time for. Called off, it is not recorded: a run
        resumed at that step (the end's, or a stop's checkpoint's) makes it."""
        if self.stop is not None and self.stop.requested:
            log.warning("the sample of step %d called off: the run is stopping", step)
            return None
        return self.sample(step, model)
