"""What a resumed run's log (metrics.jsonl) lacks at the step it resumes from, run before its
first step. A stop (a preemption) ends training at a step boundary as soon as that step's
checkpoint is committed, before the step's validation, sample and C++ evaluation (a 30 s notice
has no time for them), and calls off a C++ evaluation still running in the background. The same
command again resumes at that step: the records due there that the log lacks are made first,
with the checkpoint's weights, as training would have made them; the C++ evaluations called off
earlier are judged from their steps' checkpoints in the background while training goes on
(xtrain/train/cpp_eval.py). A run resumed at its last step makes them after fit, in
xtrain/train/finish.py: with no step left, fit calls no hook."""

from __future__ import annotations

import logging
from collections import defaultdict

import lightning as L

from xtrain.checkpoint.layout import committed_checkpoints
from xtrain.observe.plots import read_records
from xtrain.paths import url_to_fs

log = logging.getLogger(__name__)


def recorded_steps(run_dir: str) -> dict[str, set[int]]:
    """The steps the run log holds a record of, by kind; none without a log (a run dir on a new
    VM)."""
    fs, root = url_to_fs(f"{run_dir.rstrip('/')}/metrics.jsonl")
    steps: dict[str, set[int]] = defaultdict(set)
    if fs.exists(root):
        for r in read_records(run_dir):
            steps[r.get("kind")].add(r.get("step"))
    return steps


def missing_at(step: int, last: bool, recorded: dict[str, set[int]], callbacks, has_val: bool,
               eval_every: int) -> list[str]:
    """The kinds of record due at ``step`` (every kind at the ``last``; else those whose period
    divides it) that ``recorded`` lacks there. Process 0's view: the C++ callback is its own."""
    sampler, cpp = callbacks.sampler, callbacks.cpp_eval
    due = {"val": has_val and (last or step % eval_every == 0),
           "sample": sampler.tokens > 0 and (last or (sampler.every and step % sampler.every == 0)),
           "eval": cpp is not None and step % cpp.every == 0}
    return [kind for kind, wanted in due.items() if wanted and step not in recorded[kind]]


def called_off_evaluations(step: int, recorded: dict[str, set[int]], cpp,
                           ckpt_dir: str) -> list[int]:
    """The steps before ``step`` whose C++ evaluation the log lacks and whose checkpoint is still
    committed in ``ckpt_dir`` (retention may have removed it). None without a log: a run dir on
    a new VM does not say what was judged."""
    if cpp is None or not recorded:
        return []
    lacking = [s for s in range(cpp.every, step, cpp.every) if s not in recorded["eval"]]
    kept = {s for s, _ in committed_checkpoints(ckpt_dir)}
    gone = [s for s in lacking if s not in kept]
    if gone:
        log.info("the C++ evaluations of steps %s are not in the run log and their checkpoints "
                 "are gone: not judged", ", ".join(map(str, gone)))
    return [s for s in lacking if s in kept]


def run_missing(step: int, last: bool, run_dir: str, ckpt_dir: str, callbacks, processes, model,
                has_val: bool, eval_every: int, validate) -> None:
    """Make the records ``step`` lacks (:func:`missing_at`) and take the evaluations called off
    before it: process 0 reads the log and decides for all (validation, ``validate()``, is a
    collective); samples and C++ evaluations are process 0's alone, as in training."""
    def decide() -> list[str]:
        recorded = recorded_steps(run_dir)
        if callbacks.cpp_eval is not None:
            callbacks.cpp_eval.take_called_off(
                called_off_evaluations(step, recorded, callbacks.cpp_eval, ckpt_dir))
        return missing_at(step, last, recorded, callbacks, has_val, eval_every)

    # (reading the weights of called-off evaluations can outlast trainer.collective_timeout_s)
    missing = processes.broadcast(processes.primary_first("the run log's missing records", decide))
    if not missing:
        return
    which = ", ".join(missing) + (" was" if len(missing) == 1 else " were")
    log.info("step %d%s was trained before this command, but its %s not recorded: running now",
             step, ", the last," if last else "", which)
    # in training's order: the step-end hooks', then the validation
    if "sample" in missing and processes.primary:
        callbacks.sampler.sample(step, model)
    if "eval" in missing and processes.primary:  # (in the background; the end waits for it)
        callbacks.cpp_eval.evaluate(step, model)
    if "val" in missing:
        validate()


class CatchUp(L.Callback):
    """At the start of a run resumed before its last step: :func:`run_missing` at that step.
    Placed after the run's other callbacks: their ``on_train_start`` (the metrics') first."""

    def __init__(self, start_step: int, run_dir: str, ckpt_dir: str, callbacks, processes,
                 has_val: bool, eval_every: int):
        self.start_step, self.run_dir, self.ckpt_dir = start_step, run_dir, ckpt_dir
        self.callbacks, self.processes = callbacks, processes
        self.has_val, self.eval_every = has_val, eval_every

    def on_train_start(self, trainer, pl_module):
        if self.start_step == 0:
            return
        run_missing(self.start_step, False, self.run_dir, self.ckpt_dir, self.callbacks,
                    self.processes, pl_module.model, self.has_val, self.eval_every,
                    lambda: validate_in_fit(trainer))


def validate_in_fit(trainer) -> None:
    """Lightning's validation loop, run inside fit as Lightning's epoch loop runs it at a
    validation step (its ``on_advance_end``): Lightning has no public call for a validation
    within fit."""
    val_loop = trainer.fit_loop.epoch_loop.val_loop
    val_loop.restarting = False  # (the restored loop state is of the stop's step: start afresh)
    trainer.validating = True
    try:
        val_loop.run()
    finally:
        trainer.training = True
