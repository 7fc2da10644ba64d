"""The run's data loaders: optimizer-step batches for training, and the validation batches."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Loaders:
    steps: object  # optimizer-step batches for the Trainer (their position is checkpointed)
    val: object | None

    def digests(self) -> dict:
        """The shards and row groups each split reads, in order (every process packs the same
        global batch from them, so their copies on every host must agree)."""
        loaders = {"train": self.steps.loader, "val": self.val.loader if self.val else None}
        return {name: loader and [loader.units_digest, loader.sizes_digest]
                for name, loader in loaders.items()}


def build_loaders(data, trainer_cfg, seq_len: int, tokenizer, rows: int, accum: int,
                  host_rows: slice = slice(None)) -> Loaders:
    """Loaders packing ``rows`` rows per micro-batch (the global batch, the same on every
    process), of which this process keeps ``host_rows``."""
    from xtrain.data.batches import EvalBatches, StepBatches
    from xtrain.data.loader import PackedLoader, holdout_last

    train_files, val_files = data.train_files, data.val_files
    if data.holdout_last_shard:  # (a corpus built on first use is checked only here)
        train_files, val_files = holdout_last(data.train_files)
    train = PackedLoader(train_files, tokenizer, seq_len, rows, seed=trainer_cfg.seed,
                         prefetch=data.prefetch, threads=data.tokenizer_threads)
    val = None
    if val_files:
        # one pass, its last batch padded: a loop would count a small split's documents twice
        val_loader = PackedLoader(val_files, tokenizer, seq_len, rows, shuffle=False, loop=False,
                                  prefetch=2, threads=data.tokenizer_threads)
        val = EvalBatches(val_loader, -(-trainer_cfg.eval_tokens // seq_len), host_rows)
    steps = StepBatches(train, accum, repeat=trainer_cfg.overfit_batches, rows=host_rows)
    return Loaders(steps, val)
