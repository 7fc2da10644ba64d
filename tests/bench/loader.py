"""Loader throughput with on-the-fly tokenization, vs the raw tokenizer's encode_batch on the same
text (the embedded default corpus, built from /usr/include/c++)."""

from __future__ import annotations

import os
import time

COMMAND = "make bench ARGS=loader   (python -m tests.bench loader)"


def run() -> str:
    import pyarrow.parquet as pq

    from tests.conftest import compose_cfg
    from xtrain.data import prepare
    from xtrain.data.loader import PackedLoader, list_shards

    cfg = compose_cfg()
    tok = prepare(cfg.data)
    texts = []
    for shard in list_shards(cfg.data.train_files):
        texts += pq.read_table(shard, columns=["text"]).column("text").to_pylist()
    t0 = time.perf_counter()
    raw_tokens = sum(len(ids) for ids in tok.encode_batch(texts))
    raw = raw_tokens / (time.perf_counter() - t0)

    seq, rows = 2048, 8
    loader = PackedLoader(cfg.data.train_files, tok, seq, rows, seed=0, threads=2, prefetch=4)
    it = iter(loader)
    next(it)  # start-up (footers, first units) is not steady state
    t0, n = time.perf_counter(), 0
    while n * rows * (seq + 1) < raw_tokens:  # about one epoch
        next(it)
        n += 1
    ours = n * rows * (seq + 1) / (time.perf_counter() - t0)
    it.close()  # stops the producer thread
    cores = os.cpu_count()
    return (f"## Loader throughput (tokenize + pack on the fly)\n\n`{COMMAND}`: cpp_local corpus "
            f"({raw_tokens:,} tokens), rows of {seq + 1}, batch {rows}, {cores} cores.\n\n"
            f"| path | tokens/s |\n| --- | --- |\n| raw `Tokenizer.encode_batch` (HF `encode_batch_fast`) on all texts at once | {raw:,.0f} |\n"
            f"| PackedLoader (read parquet, tokenize, pack, prefetch) | {ours:,.0f} |\n\n"
            f"**ratio loader / raw = {ours / raw:.2f}** (target >= 0.8; absolute target >= 1M tok/s, "
            f"{'met' if ours >= 1e6 else 'NOT met'} on this machine)\n")
