"""The C++ benchmark during training: every ``eval.cpp_every`` steps, on rank 0, outside the
compiled step (the XLA engine's model is copied to the CPU first, as for samples, so the training
step's graphs are untouched), scores logged as ``eval`` records (metrics.jsonl and every logger)
and per-sample records written to ``<run dir>/cpp_eval/step_N.jsonl``.

The other ranks do not take part: they go on to the next step and meet rank 0 again at that
step's first collective. Rank 0 evaluates synchronously, so on a pod the evaluation's wall time is
charged to every host at that step (reported as ``cpp_eval_seconds``); a pod host holds only its
shards of the weights, so there the evaluation is skipped with a warning, like samples.
"""

from __future__ import annotations

import lightning as L

from xtrain.evals import prepare
from xtrain.evals.completions import check_fit, evaluate_model, records_path
from xtrain.train.sampling import host_copy_or_none


class CppEvalCallback(L.Callback):
    """Built only when ``eval.cpp_every`` > 0; the config, the benchmark file, the compiler in
    the sandbox and the prompts' fit in the context are checked when it is built (before the
    first step), not at the first evaluation."""

    def __init__(self, eval_cfg, tokenizer, run_log, timer, run_dir: str, sequence_len: int):
        self.cfg, self.tokenizer, self.run_log, self.timer = eval_cfg, tokenizer, run_log, timer
        self.run_dir, self.every = run_dir, eval_cfg.cpp_every
        self.problems = prepare(eval_cfg)
        check_fit(tokenizer, self.problems, eval_cfg, sequence_len)

    def evaluate(self, step: int, model) -> dict | None:
        with self.timer.measure("cpp_eval"):  # not charged to training throughput
            was_training = model.training
            cpu_model = host_copy_or_none(model, "C++ evaluation")
            if cpu_model is None:
                self.every = 0
                return None
            try:
                scores = evaluate_model(cpu_model, self.tokenizer, self.problems, self.cfg,
                                        records_path(self.run_dir, step))
            finally:
                model.train(was_training)
        return self.run_log.record("eval", step, scores)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        step = trainer.global_step
        if self.every and step % self.every == 0 and trainer.global_rank == 0:
            self.evaluate(step, pl_module.model)
