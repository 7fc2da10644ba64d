"""What a resumed run's log (metrics.jsonl) lacks at the step it resumes from, run before its
first step. A stop (a preemption) ends training at a step boundary as soon as that step's
checkpoint is committed, before the step's validation, sample and C++ evaluation (a 30 s notice
has no time for them), and calls off a C++ evaluation still running in the background. The same
command again resumes at that step: the records due there that the log lacks are made first,
with the checkpoint's weights, as training would have made them; the C++ evaluations that were
unfinished when that checkpoint was saved (its own record of them, xtrain/train/cpp_eval.py) and
that the log lacks are judged from their steps' checkpoints in the background, one at a time,
while training goes on. A run resumed at its last step makes them after fit, in
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
    """The kinds of record due at ``step`` (validation and sample at the ``last`` whatever their
    period; else, and the C++ evaluation always, those whose period divides it) that
    ``recorded`` lacks there. Process 0's view: the C++ callback is its own."""
    sampler, cpp = callbacks.sampler, callbacks.cpp_eval
    due = {"val": has_val and (last or step % eval_every == 0),
           "sample": sampler.tokens > 0 and (last or (sampler.every and step % sampler.every == 0)),
           "eval": cpp is not None and step % cpp.every == 0}
    return [kind for kind, wanted in due.items() if wanted and step not in recorded[kind]]


def called_off_evaluations(step: int, recorded: dict[str, set[int]], unfinished: list[int],
                           ckpt_dir: str) -> list[int]:
    """Of the C++ evaluations ``unfinished`` when the checkpoint at ``step`` was saved, those the
    log lacks whose step's checkpoint is still committed in ``ckpt_dir`` (retention may have
    removed it)."""
    lacking = [s for s in unfinished if s < step and s not in recorded["eval"]]
    if not lacking:  # (no listing of a gs:// dir at every resume)
        return []
    kept = {s for s, _ in committed_checkpoints(ckpt_dir)}
    for s in lacking:
        log.info("step %d's C++ evaluation was unfinished when step %d's checkpoint was saved: %s",
                 s, step, "judging it from its own" if s in kept else "no checkpoint of it is kept")
    return [s for s in lacking if s in kept]


def run_missing(step: int, last: bool, run_dir: str, ckpt_dir: str, callbacks, processes, model,
                has_val: bool, eval_every: int, validate) -> None:
    """Make the records ``step`` lacks (:func:`missing_at`) and judge the evaluations called
    off before it (:func:`called_off_evaluations`): process 0 reads the log and decides for all
    (validation, ``validate()``, is a collective); samples and C++ evaluations are process 0's
    alone, as in training."""
    missing, cpp, unfinished = None, callbacks.cpp_eval, []
    if processes.primary:
        recorded = recorded_steps(run_dir)
        missing = missing_at(step, last, recorded, callbacks, has_val, eval_every)
        if cpp is not None:
            unfinished = called_off_evaluations(step, recorded, cpp.unfinished, ckpt_dir)
    missing = processes.broadcast(missing)
    if missing:
        which = ", ".join(missing) + (" was" if len(missing) == 1 else " were")
        log.info("step %d%s was trained before this command, but its %s not recorded: running "
                 "now", step, ", the last," if last else "", which)
    # the sample and the C++ evaluation first, then the validation (a step's end in training)
    if "sample" in missing and processes.primary:
        callbacks.sampler.sample_unless_stopping(step, model)
    if "eval" in missing and processes.primary:  # (in the background; the end waits for it)
        cpp.evaluate(step, model)
    if unfinished:  # (after this step's own: on several processes one running skips another)
        cpp.judge_later(unfinished)
    if "val" in missing:
        validate()


class CatchUp(L.Callback):
    """At the start of a run resumed before its last step: :func:`run_missing` at that step.
    The trainer's last callback (xtrain/train/run.py): the other callbacks' ``on_train_start``
    (the metrics', the engine's) come first."""

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
