"""The C++ benchmark during training: every ``eval.cpp_every`` steps, on rank 0, outside the
compiled step, in the background. Training pays only for a CPU snapshot of the weights (a fresh
model loaded with copies of them; on the XLA engine the host copy samples use, so the training
step's graphs are untouched); generation, compiling and testing run on one background thread
while the steps go on. The scores are logged as an ``eval`` record of the step whose weights were
judged (metrics.jsonl and every logger) by the training thread, at the first step end after the
evaluation finished, and per-sample records go to ``<run dir>/cpp_eval/step_N.jsonl``.

The other ranks do not take part and rank 0 does not stop for the evaluation, so the other hosts
of a pod are not held at their next collective: one due while another still runs is skipped (the
last step's deferred), and the end waits for the last through the rendezvous store, which has no
timeout (xtrain/train/finish.py). On more than one process a host may hold only its
shards of the weights (a pod), so there the weights come from the checkpoint of the step instead
(``eval.cpp_every`` is a multiple of ``checkpoint.every``, xtrain/inputs.py): the background
thread waits for it to be committed and reads it from the checkpoint directory, which every host
shares; nothing is gathered across hosts and nothing extra is compiled.
"""

from __future__ import annotations

import logging
import threading
import time

import lightning as L

from xtrain.checkpoint.io import read_model_weights
from xtrain.checkpoint.layout import committed_checkpoints, is_committed, step_dir, step_of
from xtrain.evals import prepare
from xtrain.evals.completions import Cancelled, evaluate_model, records_path
from xtrain.model.gpt import GPT
from xtrain.train.sampling import host_copy

log = logging.getLogger(__name__)
# how long an evaluation waits for the checkpoint of its step to be committed (the upload of a
# large model's checkpoint to gs:// takes minutes); then that evaluation is skipped with a warning
COMMIT_WAIT_S = 3600.0


def cpu_snapshot(model):
    """A CPU model holding copies of ``model``'s weights that training never touches again (a
    one-process run: this process holds every weight). Not the live model (training updates it
    in place) and not a deepcopy of it (under ``trainer.compile`` its forward is an instance
    attribute wrapping the live model, xtrain/engines/torch_compile.py)."""
    cpu_model = host_copy(model)
    if cpu_model is not model:  # the XLA engine's host copy is already one
        return cpu_model
    return GPT.from_weights(model.config, model.state_dict())


def committed_weights(config, path: str, stopping: threading.Event, given_up=lambda: False):
    """The CPU model of the checkpoint at ``path`` once it is committed, or None when it is not
    within ``COMMIT_WAIT_S``, the run is stopping, a later step committed without it (its
    upload gave up, or retention removed it before it was read), or ``given_up()`` (the end's
    save gave up: nothing commits any more)."""
    deadline = time.monotonic() + COMMIT_WAIT_S
    while not is_committed(path):
        if (stopping.wait(2.0) or time.monotonic() > deadline or given_up()
                or _passed_over(path)):
            return None
    return GPT.from_weights(config, read_model_weights(path))


def _passed_over(path: str) -> bool:
    step, directory = step_of(path), path.rstrip("/").rsplit("/", 1)[0]
    return any(later > step for later, _ in committed_checkpoints(directory)) and not is_committed(path)


class Pending:
    """One evaluation on its background thread; ``scores`` (None: skipped) or ``error`` once it
    is done. ``snapshot_s``: what copying the weights cost training (None: read from a
    checkpoint instead)."""

    def __init__(self, step: int, snapshot_s: float | None, run):
        self.step, self.snapshot_s = step, snapshot_s
        self.scores: dict | None = None
        self.error: BaseException | None = None
        # a daemon, so a run that dies without reaching a callback hook is not kept alive by it
        self.thread = threading.Thread(target=self._main, args=(run,), name=f"cpp-eval-{step}",
                                       daemon=True)
        self.thread.start()

    def _main(self, run) -> None:
        try:
            self.scores = run()
        except BaseException as e:  # handed to the training thread, raised there
            self.error = e


class CppEvalCallback(L.Callback):
    """Built only when ``eval.cpp_every`` > 0; the config, the benchmark file, the compiler in
    the sandbox and the prompts' fit in the context are checked when it is built (before the
    first step), not at the first evaluation.

    At most one evaluation is in flight: when the next is due while the previous one still runs,
    training waits for the running one first (its record says how long: ``cpp_wait_seconds``),
    so evaluations never pile up when one takes longer than ``eval.cpp_every`` steps. Training
    also waits for the running one when it ends normally, so the last evaluation's record is
    written before the run's loggers close; when it ends by an exception (a preemption
    included), or a stop is requested while training waits for it, it is called off with a
    warning: generating, at its next token; judging, its samples not judged yet skipped and its
    running compiles and programs killed. On a host CPU a large model's generation takes
    minutes, and judging ``eval.n`` samples of every problem can too: a preemption notice gives
    neither. An evaluation that fails (its sandbox, the storage of its records) is a warning, and
    training goes on: the config, the benchmark and the toolchain were checked before the first
    step, and an evaluation is no reason to lose the steps since the last checkpoint.
    Records are written by the training thread only (the background thread hands its scores
    back), in step order with the other records of that step end."""

    def __init__(self, eval_cfg, tokenizer, run_log, timer, run_dir: str, gpt_config,
                 checkpoints: str, from_checkpoints: bool, stop=None):
        """``gpt_config``: the trained model's. ``checkpoints``: the run's checkpoint directory;
        each step's weights are read from it with ``from_checkpoints`` (a run of more than one
        process), else snapshot from the live model. ``stop``: the run's StopRequest
        (xtrain/train/preemption.py): a stop requested while training waits for an evaluation
        calls that evaluation off."""
        self.stop = stop
        self.cfg, self.tokenizer, self.run_log, self.timer = eval_cfg, tokenizer, run_log, timer
        self.run_dir, self.every, self.checkpoints = run_dir, eval_cfg.cpp_every, checkpoints
        self.gpt_config, self.from_checkpoints = gpt_config, from_checkpoints
        self.problems = prepare(eval_cfg)  # (their prompts fit: xtrain/train/sampling.py)
        self.pending: Pending | None = None
        self.deferred = None  # (step, model): the last step's, due while another still ran
        # steps whose evaluation was unfinished when the checkpoint this run resumed from was
        # saved (:meth:`state_dict`), and those of them to judge (xtrain/train/catch_up.py)
        self.unfinished: list[int] = []
        self.backlog: list[int] = []
        self.called_off: list[int] = []  # by a stop, in this run
        self.saves_over = threading.Event()  # nothing commits any more (:meth:`no_more_saves`)
        self.stopping = threading.Event()  # set when the run ends by an exception

    def evaluate(self, step: int, model, last: bool = False) -> None:
        """Start the evaluation of ``model``'s weights at ``step`` (after the running one ends).
        On several processes, where waiting for the running one would hold the others at their
        next collective until its timeout, one due meanwhile is skipped; the ``last`` step's is
        deferred to :meth:`finish`."""
        if self.from_checkpoints and self.pending is not None and self.pending.thread.is_alive():
            if last:
                self.deferred = (step, model)
            else:
                log.warning("C++ evaluation of step %d skipped: step %d's still runs (process 0 "
                            "waiting for it would hold the other processes)", step, self.pending.step)
            return
        self.collect(wait=True)
        if self.from_checkpoints:
            self.evaluate_checkpoint(step)
            return
        # the snapshot and any wait are what training pays; like validation, not throughput
        with self.timer.measure("eval"):
            t0 = time.perf_counter()
            snapshot = cpu_snapshot(model)
            snapshot_s = time.perf_counter() - t0
        path = records_path(self.run_dir, step)
        self.pending = Pending(step, snapshot_s, lambda: evaluate_model(
            snapshot, self.tokenizer, self.problems, self.cfg, path, self.stopping))

    def evaluate_checkpoint(self, step: int) -> None:
        """The evaluation of the weights in ``step``'s checkpoint, read on the background thread
        once it is committed (a checkpoint that cannot be read fails that evaluation alone)."""
        checkpoint, path = step_dir(self.checkpoints, step), records_path(self.run_dir, step)

        def from_checkpoint():
            weights = committed_weights(self.gpt_config, checkpoint, self.stopping,
                                        self.saves_over.is_set)
            if weights is None:
                log.warning("C++ evaluation of step %d skipped: %s was not committed", step,
                            checkpoint)
                return None
            return evaluate_model(weights, self.tokenizer, self.problems, self.cfg, path,
                                  self.stopping)

        self.pending = Pending(step, None, from_checkpoint)

    def no_more_saves(self) -> None:
        """The end's save gave up, so no checkpoint not committed yet ever will be (a lasting
        storage outage gives up earlier saves too): every evaluation from checkpoints waiting for
        one, or still to start, is skipped at once."""
        self.saves_over.set()

    def state_dict(self) -> dict:
        """Saved in every checkpoint: the evaluations unfinished at its save (called off, running,
        deferred or still to judge; the step's own starts after the save), which a stop calls
        off and a crash loses."""
        running = [self.pending.step] if self.pending is not None else []
        deferred = [self.deferred[0]] if self.deferred is not None else []
        return {"unfinished": self.called_off + running + deferred + self.backlog}

    def load_state_dict(self, state_dict: dict) -> None:
        self.unfinished = list(state_dict.get("unfinished", []))

    def judge_later(self, steps: list[int]) -> None:
        """Judge ``steps`` from their checkpoints when no other evaluation runs: the first now."""
        self.backlog += steps
        if self.backlog and self.pending is None:
            self.evaluate_checkpoint(self.backlog.pop(0))

    def collect(self, wait: bool) -> dict | None:
        """Log the pending evaluation's record if it has finished (or, with ``wait``, once it
        has); the record, or None when there is none (yet)."""
        pending = self.pending
        if pending is None or (not wait and pending.thread.is_alive()):
            return None
        with self.timer.measure("eval"):
            t0 = time.perf_counter()
            while pending.thread.is_alive():
                pending.thread.join(0.1)
                if self.stop is not None and self.stop.requested:
                    self.stopping.set()  # called off (Cancelled) within a token or 0.1 s
            waited = time.perf_counter() - t0
        self.pending = None
        if isinstance(pending.error, Cancelled):
            log.warning("C++ evaluation of step %d abandoned: the run stopped before it finished",
                        pending.step)
            self.called_off.append(pending.step)
            return None
        if isinstance(pending.error, (KeyboardInterrupt, SystemExit)):
            raise pending.error
        if pending.error is not None:  # (DCP's CheckpointException is a BaseException too)
            log.warning("C++ evaluation of step %d failed, training goes on: %s: %s",
                        pending.step, type(pending.error).__name__, pending.error)
            return None
        if pending.scores is None:  # its checkpoint never came
            return None
        snapshot = {} if pending.snapshot_s is None else {
            "cpp_snapshot_seconds": round(pending.snapshot_s, 3)}
        return self.run_log.record("eval", pending.step, {
            **pending.scores, **snapshot, "cpp_wait_seconds": round(waited, 3)})

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.collect(wait=False)  # built on rank 0 only (xtrain/train/run.py)
        step = trainer.global_step
        if step % self.every == 0:
            self.evaluate(step, pl_module.model, last=step == trainer.max_steps)
        elif self.backlog and self.pending is None:
            self.evaluate_checkpoint(self.backlog.pop(0))

    def finish(self) -> None:
        """After training (xtrain/train/finish.py): the running evaluation's record, then the
        deferred last step's, then the backlog's."""
        self.collect(wait=True)
        if self.deferred is not None and not self._stopped():
            (step, model), self.deferred = self.deferred, None
            self.evaluate(step, model)
            self.collect(wait=True)
        while self.backlog and not self._stopped():
            self.evaluate_checkpoint(self.backlog.pop(0))
            self.collect(wait=True)

    def _stopped(self) -> bool:
        return self.stop is not None and self.stop.requested

    def on_exception(self, trainer, pl_module, exception):
        # a checkpoint still awaited may never be committed now; the evaluation is called off
        self.stopping.set()
        try:
            self.collect(wait=True)
        except Exception as e:  # the run's own exception is the one that propagates
            log.warning("the C++ evaluation failed too: %r", e)
