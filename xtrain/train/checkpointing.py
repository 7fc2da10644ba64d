"""Training-time checkpoint policy: when to save (every N steps, at the end, on a stop request),
what to prune after each commit, and which commits a resumed run renames aside (never deletes).
Which checkpoint a run starts from: xtrain/inputs.py."""

from __future__ import annotations

from contextlib import nullcontext

import lightning as L
from lightning.pytorch.utilities.exceptions import SIGTERMException

from xtrain.checkpoint.async_io import FsspecCheckpointIO
from xtrain.checkpoint.layout import (latest_checkpoint, newer_commits, set_aside, stale_checkpoints,
                                     step_dir, step_dirs, surely_uncommitted)
from xtrain.errors import CheckpointNotWritten, warn
from xtrain.train.preemption import StopRequest


def set_aside_newer(step: int, directory: str, reason: str) -> None:
    """Rename aside (``step_N.<reason>-<time>``, kept, out of discovery's sight) the commits in
    ``directory`` past ``step``, the one the run resumes from: each would otherwise be replaced
    when the run reached its step, and a later resume would pick it over the run's own newer work."""
    why = {"corrupt": "corrupt, passed over", "rewound": "newer than the step checkpoint.rewind "
           "resumes from"}.get(reason, reason)
    for path in newer_commits(directory, step):
        warn(f"checkpoint {path} ({why}) renamed aside to {set_aside(path, reason)}: kept for "
             "inspection, not deleted")


class PeriodicCheckpoint(L.Callback):
    """Saves every ``every`` steps (asynchronously), at the last step (before the final
    validation) and when a stop (preemption) is requested (both waiting for the commit); after
    each commit prunes by retention and removes torn attempts older than it, and reports the
    save's seconds."""

    def __init__(self, directory: str, every: int, checkpoint_io: FsspecCheckpointIO,
                 keep_last: int = 2, keep_every: int = 0, meta: dict | None = None,
                 stop: StopRequest | None = None, report=None, timer=None):
        self.directory, self.every, self.io = directory.rstrip("/"), every, checkpoint_io
        self.keep_last, self.keep_every = max(1, keep_last), keep_every
        self.meta, self.stop, self.report = meta or {}, stop, report
        self.timer = timer  # a PhaseTimer (xtrain/observe/metrics.py): blocking save time
        self.last_saved_step = None
        self.preempted = False
        self.preemption_saved = False  # the stop's checkpoint committed (False: upload gave up)
        self.final_saved = None  # the end's likewise (None: training did not end, nothing saved)
        checkpoint_io.on_commit = self._committed

    def save(self, trainer, wait: bool = False) -> bool:
        """Save this step (once); with ``wait``, True when it committed. A save the dir's lease
        was lost during raises LeaseLost (the run's refusal) rather than report a failed save."""
        with self.timer.measure("checkpoint") if self.timer else nullcontext():
            if trainer.global_step != self.last_saved_step:
                trainer.save_checkpoint(step_dir(self.directory, trainer.global_step))
                self.last_saved_step = trainer.global_step
            committed = wait and self.io.wait() is not None  # None: the upload gave up (it warned)
            if wait and self.io.lost is not None:
                raise self.io.lost
            return committed

    def _committed(self, result: dict) -> None:
        """Upload thread: the checkpoint at ``result['step']`` is committed. Retention counts
        only the commits up to it: newer ones (a damaged one resume passed over, or those after
        a ``checkpoint.resume`` of an older step) never push this run's own out. Nothing is
        pruned unless the checkpoint dir's lease (the io's fence) is still this training's: a
        training that took the dir over keeps every checkpoint of its own."""
        if self.io.fence is not None:
            try:
                self.io.fence()
            except Exception as e:  # noqa: BLE001  (taken over since the commit, or unread)
                warn(f"no old checkpoint removed after this commit: the checkpoint dir's lease "
                     f"could not be confirmed ({type(e).__name__}: {e})")
                self._report(result)
                return
        dirs = step_dirs(self.directory)
        committed = [s for s, _, done in dirs if done and s <= result["step"]]
        doomed = set(stale_checkpoints(committed, self.keep_last, self.keep_every))
        for step, path, done in dirs:
            if step in doomed or (not done and step < result["step"] and surely_uncommitted(path)):
                try:
                    self.io.remove_checkpoint(path)
                except Exception as e:  # noqa: BLE001  (storage errors come in many types)
                    # the commit stands: a failed deletion must not fail the next save
                    warn(f"could not remove the old checkpoint {path} ({type(e).__name__}: {e}); "
                         "tried again after the next commit")
        self._report(result)

    def _report(self, result: dict) -> None:
        if self.report:
            self.report({k: v for k, v in result.items() if k != "path"})

    def check_final_saved(self, step: int) -> None:
        """After training: raise CheckpointNotWritten when it ended at ``step`` but its final
        checkpoint could not be written (a run must not look finished without its weights)."""
        if self.final_saved is False and not self.preempted:
            raise CheckpointNotWritten(
                f"training reached step {step}, but its final checkpoint could not be written (the "
                f"warnings above say why); the newest committed one is "
                f"{latest_checkpoint(self.directory)}: run the same command to train again from it")

    def on_save_checkpoint(self, trainer, pl_module, checkpoint):
        checkpoint["xtrain_meta"] = self.meta

    def on_train_start(self, trainer, pl_module):
        if self.stop is not None:
            self.stop.install()  # (installed before fit already; again costs nothing)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.stop is not None and self.stop.agreed():
            self.preemption_saved = self.save(trainer, wait=True)  # committed before exit
            self.preempted = True
            # Lightning's stop-by-signal exception, raised now: with only should_stop set it would
            # still run validation, which a 30 s preemption notice has no time for
            raise SIGTERMException
        elif trainer.global_step >= trainer.max_steps:
            # committed before the final validation, which Lightning runs after this hook: a
            # validation that fails then loses no trained step
            self.final_saved = self.save(trainer, wait=True)
            if self.stop is not None:
                self.stop.past_last_step.set()
        elif self.every and trainer.global_step % self.every == 0:
            self.save(trainer)

    def on_train_end(self, trainer, pl_module):
        if self.stop is not None:
            self.stop.settle()
        if self.final_saved is None:  # training ended before its last step (Lightning stopped it)
            self.final_saved = self.save(trainer, wait=True)
