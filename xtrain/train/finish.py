"""How a training ends: finished, or stopped (:func:`end_status`). And the end of a run resumed at
its last step: the step was trained and its checkpoint committed by an earlier command that
stopped (a preemption, a lost host) before the end's validation, sample or C++ evaluation was
recorded. The last step's checkpoint is committed before the final validation
(xtrain/train/checkpointing.py), so that a failing validation loses no trained step; run again,
Lightning's fit finds no step left and calls no hook, so what the run log lacks at the last step
is made here, after fit, with the checkpoint's weights (xtrain/train/catch_up.py)."""

from __future__ import annotations

import logging

from xtrain.train.catch_up import run_missing

log = logging.getLogger(__name__)


def finish_end(trainer, module, val_loader, callbacks, run_dir: str, ckpt_dir: str, processes,
               cfg, start_step: int, max_steps: int) -> None:
    """After fit: what the end lacks (a run resumed at its last step: a re-run's preemption
    record and the records its log lacks there, xtrain/train/catch_up.py; a validation of a
    last step fit did not validate, :func:`validate_end`), then the wait for the C++
    evaluations still running or due (none after a stop, which called them off; none waiting
    for a checkpoint once the end's save gave up)."""
    stopped_early = callbacks.checkpointer.preempted
    if start_step == max_steps:
        callbacks.metrics.record_preemptions(start_step, processes.rank)
        run_missing(start_step, True, run_dir, ckpt_dir, callbacks, processes, module.model,
                    val_loader is not None, cfg.trainer.eval_every or max_steps,
                    lambda: trainer.validate(module, dataloaders=val_loader, verbose=False))
    elif trainer.global_step == max_steps and not stopped_early:
        validate_end(trainer, module, val_loader, max_steps, cfg.trainer.eval_every or max_steps)
    if cfg.eval.cpp_every and not stopped_early:
        if callbacks.checkpointer.final_saved is False and callbacks.cpp_eval is not None:
            callbacks.cpp_eval.no_more_saves()
        wait_for_evaluation(callbacks.cpp_eval, processes)


def validate_end(trainer, module, val_loader, step: int, eval_every: int) -> None:
    """The end's validation, the run's final figure, when Lightning's fit, which validates at
    multiples of ``eval_every``, did not give one at the last ``step``."""
    if val_loader is None or step % eval_every == 0:
        return
    log.info("step %d, the last, is not a multiple of trainer.eval_every=%d: validating it",
             step, eval_every)
    trainer.validate(module, dataloaders=val_loader, verbose=False)


def wait_for_evaluation(cpp_eval, processes) -> None:
    """The end of the C++ evaluation (``cpp_eval``, process 0's callback; None elsewhere): the
    other processes wait on the rendezvous store for as long as it takes while process 0 lives;
    in a collective they would give up after trainer.collective_timeout_s, which an evaluation
    of a large model on a host's CPU can outlast."""
    processes.primary_first("the C++ evaluations still running or due",
                            lambda: cpp_eval.finish() if cpp_eval is not None else None)


def end_status(callbacks, run_log, step: int, processes) -> str:
    """"preempted" when a stop ended training at a step boundary (the processes agreed on it), or
    arrived at process 0 after the last one: the end's C++ evaluation and sample, process 0's
    work, were called off, and the same command again records what the end lacks
    (xtrain/train/catch_up.py); the ``stop`` record says why, for the launcher
    (xtrain/observe/preemptions.py). Else "success": a stop that reached only other processes
    after the last step left nothing of the end undone (its work is process 0's)."""
    from xtrain.observe.preemptions import stop_record

    stop = callbacks.stop
    if callbacks.checkpointer.preempted:
        cause = stop.stopped_for
    else:  # (every process calls this: a collective)
        cause = processes.broadcast(stop.cause if stop.requested else None)
    stop.end_done.set()  # decided: a stop from now on changes nothing
    if cause is None:
        return "success"
    run_log.record("stop", step, stop_record(cause, stop.reason))
    return "preempted"


def stopped(callbacks, step: int, newest: str | None) -> dict:
    """Say where a stopped run is (its ``end_status`` is "preempted"); its result."""
    committed = callbacks.checkpointer.preemption_saved or callbacks.checkpointer.final_saved
    saved = ("checkpoint committed" if committed else
             f"its checkpoint could not be written, the newest committed one is {newest}")
    log.info("stopped (%s) at step %d: %s; run the same command to resume",
             callbacks.stop.reason or "another process was told to stop", step, saved)
    return {"step": step, "checkpoint": newest, "preempted": True}
