"""Streaming, resumable loader: parquet shards (any fsspec URL) -> packed ``[rows, T+1]`` batches.

- Work is split into *units* (one parquet row group each). Each epoch shuffles the units with a
  seed-derived RNG. A loader of ``rank`` of ``world`` takes units ``rank, rank + world, ...``
  (disjoint, their union the epoch); training does not split them so (world 1): every process
  packs the same global batch and keeps its own rows (xtrain/data/batches.py), so a batch's rows
  do not depend on the number of processes and a resume on another count is exact.
- Units are read and tokenized ahead in background threads; a producer thread packs rows and
  keeps ``prefetch`` batches ready, so the training step does not wait on tokenization.
- Packing is BOS-aligned best-fit (nanochat's): every row starts with a document's BOS; the row
  is filled with the largest buffered document that fits the remaining space; when none fits,
  the shortest one is cropped to fill the row exactly (its tail is dropped). Rows are never
  padded, with one exception: a non-looping pass (validation) pads its last batch with ``PAD``
  (-1), which the loss ignores. ``cropped_tokens`` counts what cropping drops.
- ``state_dict()`` describes the position after the last batch *handed out* (not the last one
  prefetched): epoch, unit cursor and references to the buffered documents, which
  ``load_state_dict`` re-reads. Resuming yields exactly the batches an uninterrupted run would.
"""

from __future__ import annotations

import bisect
import hashlib
import queue
import threading
from collections import OrderedDict, deque
from concurrent.futures import ThreadPoolExecutor

import fsspec
import numpy as np

from xtrain.data.tokenizer import Tokenizer
from xtrain.errors import DataError
from xtrain.paths import as_url, url_to_fs

PAD = -1  # only in the last batch of a non-looping pass; an ignored target, never a real token
# what a position (PackedLoader.state_dict) holds that resuming reads, and of which types
POSITION_FIELDS = {"epoch": int, "cursor": int, "buffer": list, "seed": int, "rank": int, "world": int}


def list_shards(files: str) -> list[str]:
    """Parquet shards of ``files`` (a directory, a glob, or one shard), as URLs, sorted."""
    fs, path = url_to_fs(files)
    if any(ch in path for ch in "*?["):
        paths = fs.glob(path)
    elif fs.isdir(path):
        paths = [p for p in fs.ls(path, detail=False) if p.endswith(".parquet")]
    elif path.endswith(".parquet") and fs.isfile(path):
        paths = [path]
    else:
        raise DataError(f"{files}: no such directory (nor a .parquet file)")
    if not paths:
        raise DataError(f"{files}: no parquet shards found")
    return sorted(as_url(fs, p) for p in paths)


def holdout_last(files: str) -> tuple[list[str], list[str]]:
    """The shards of ``files`` as (training, validation): the last one held out, nanochat's
    convention (data.holdout_last_shard)."""
    shards = list_shards(files)
    if len(shards) < 2:
        raise DataError(f"data.train_files={files}: holdout_last_shard needs at least 2 shards, "
                        f"found {len(shards)}")
    return shards[:-1], shards[-1:]


def index_units(shards: list[str], threads: int = 8) -> list[tuple[str, int, int, int]]:
    """(shard, row group, its rows, the shard's bytes) units, reading each footer once; checks
    each shard up front."""
    import pyarrow.parquet as pq

    def footer(url):
        try:
            with fsspec.open(url, "rb") as f:
                meta, size = pq.ParquetFile(f).metadata, f.size
        except Exception as e:  # pyarrow raises several types for a damaged file
            raise DataError(f"{url}: not a readable parquet file ({e})") from e
        columns = meta.schema.to_arrow_schema()  # (parquet's own schema names leaves: meta.text)
        if "text" not in columns.names:
            raise DataError(f"{url}: no 'text' column (columns: {columns.names})")
        kind = columns.field("text").type
        if not is_text(kind):
            raise DataError(f"{url}: the 'text' column holds {kind}, not strings")
        column = [meta.schema.column(i).path for i in range(meta.num_columns)].index("text")
        for rg in range(meta.num_row_groups):  # where the writer kept statistics (most do)
            stats = meta.row_group(rg).column(column).statistics
            if stats is not None and stats.has_null_count and stats.null_count:
                raise DataError(f"{url}: row group {rg} has {stats.null_count} null text(s); "
                                "drop or fill them")
        return [(url, rg, meta.row_group(rg).num_rows, size) for rg in range(meta.num_row_groups)
                if meta.row_group(rg).num_rows]

    with ThreadPoolExecutor(threads) as pool:
        units = [u for us in pool.map(footer, shards) for u in us]
    if not units:
        raise DataError(f"{shards[0]}...: the shards hold no rows")
    return units


def is_text(kind) -> bool:
    """An arrow type that reads as Python strings (plain, large, view, or dictionary-encoded)."""
    import pyarrow as pa

    if pa.types.is_dictionary(kind):
        kind = kind.value_type
    types = pa.types
    return types.is_string(kind) or types.is_large_string(kind) or types.is_string_view(kind)


def read_unit(unit: tuple[str, int, int, int]) -> list[str]:
    import pyarrow.parquet as pq

    url, rg = unit[:2]
    try:
        with fsspec.open(url, "rb") as f:
            texts = pq.ParquetFile(f).read_row_group(rg, columns=["text"]).column("text").to_pylist()
    except Exception as e:
        raise DataError(f"{url}: failed reading row group {rg} ({e})") from e
    if None in texts:  # a writer without statistics: index_units could not see it
        raise DataError(f"{url}: row group {rg} has {texts.count(None)} null text(s); drop or fill them")
    return texts


def units_digest(units: list[tuple[str, int, int, int]], sizes: bool = False) -> str:
    """What a saved position counts in: each unit's shard file name and row group, in order (not
    where the shards live: the same corpus moved elsewhere is the same data); with ``sizes``,
    also its rows and its shard's bytes, which a corpus rebuilt or rewritten under the same
    names (other documents, other row groups) changes."""
    names = "\n".join(f"{url.rstrip('/').rsplit('/', 1)[-1]}#{rg}"
                      + (f":{rows}:{size}" if sizes else "") for url, rg, rows, size in units)
    return hashlib.sha256(names.encode()).hexdigest()[:16]


class BestFitBuffer:
    """Buffered documents bucketed by length, so "the largest that fits" is a bisection instead
    of a scan (the scan was the loader's bottleneck). Ties go to the earliest buffered document."""

    def __init__(self):
        self._by_len: dict[int, deque] = {}
        self._lengths: list[int] = []  # sorted distinct lengths
        self._seq = 0
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def add(self, ref, doc) -> None:
        n = len(doc)
        if n not in self._by_len:
            bisect.insort(self._lengths, n)
            self._by_len[n] = deque()
        self._by_len[n].append((self._seq, ref, doc))
        self._seq += 1
        self._size += 1

    def pop_best(self, space: int):
        """(doc, cropped tokens): the largest document <= space, else the shortest one cropped."""
        i = bisect.bisect_right(self._lengths, space)
        n = self._lengths[i - 1] if i else self._lengths[0]
        bucket = self._by_len[n]
        _, _, doc = bucket.popleft()
        if not bucket:
            del self._by_len[n]
            self._lengths.remove(n)
        self._size -= 1
        return doc[:space], max(0, n - space)

    def refs(self) -> list:
        """References of the buffered documents, in the order they were buffered."""
        return [ref for _, ref, _ in sorted(item for b in self._by_len.values() for item in b)]


class PackedLoader:
    def __init__(self, files: str | list[str], tokenizer: Tokenizer, seq_len: int, rows: int, *,
                 seed: int = 0, rank: int = 0, world: int = 1, shuffle: bool = True, loop: bool = True,
                 prefetch: int = 4, threads: int = 2, buffer_docs: int = 256):
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} not in [0, {world})")
        self.tokenizer, self.row_len, self.rows = tokenizer, seq_len + 1, rows
        self.seed, self.rank, self.world = seed, rank, world
        self.shuffle, self.loop, self.prefetch, self.threads = shuffle, loop, prefetch, threads
        self.buffer_docs = buffer_docs
        shards = list(files) if isinstance(files, (list, tuple)) else list_shards(files)
        self.units = index_units(shards, threads=max(threads, 4))
        if len(self.units) < world:
            raise DataError(f"{files}: {len(self.units)} row groups cannot be split over {world} hosts")
        self.units_digest = units_digest(self.units)
        self.sizes_digest = units_digest(self.units, sizes=True)
        self._state = {"epoch": 0, "cursor": 0, "buffer": []}
        self._orders: dict[int, list[int]] = {}
        self.cropped_tokens = 0

    # --- order ------------------------------------------------------------------------------
    def epoch_units(self, epoch: int) -> list[int]:
        """Indices of this host's units, in this epoch's order."""
        if epoch not in self._orders:
            order = np.arange(len(self.units))
            if self.shuffle:
                np.random.default_rng([self.seed, epoch]).shuffle(order)
            self._orders = {epoch: order[self.rank::self.world].tolist()}  # keep only the current
        return self._orders[epoch]

    # --- resumable state --------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"epoch": self._state["epoch"], "cursor": self._state["cursor"],
                "buffer": [list(ref) for ref in self._state["buffer"]], "seed": self.seed,
                "rank": self.rank, "world": self.world, "units": self.units_digest,
                "sizes": self.sizes_digest, "unit_count": len(self.units)}

    def load_state_dict(self, state: dict) -> None:
        self.check_position(state)
        self._state = {"epoch": state["epoch"], "cursor": state["cursor"],
                       "buffer": [tuple(ref) for ref in state["buffer"]]}

    def check_position(self, state: dict) -> None:
        """Refuse a saved position (:meth:`state_dict`) this loader cannot continue from: another
        seed or process numbering, or other data (shards added or removed, or rebuilt)."""
        if (state["seed"], state["rank"], state["world"]) != (self.seed, self.rank, self.world):
            raise DataError(f"the checkpoint's data position is for seed {state['seed']} on process "
                            f"{state['rank']} of {state['world']}, this run's loader for seed "
                            f"{self.seed} on process {self.rank} of {self.world}: resume with the "
                            "trainer.seed and the number of processes the run was saved with")
        if state.get("units", self.units_digest) != self.units_digest:  # (older states: none)
            raise DataError(
                f"the checkpoint's data position counts {state['unit_count']} row groups of other "
                f"shards than this data's {len(self.units)}: resumed, it would read other documents "
                "than the run had left (some twice, some never); resume with the shards the run "
                "trained on, or train a new run from step 0 (another run.name, no "
                "checkpoint.resume)")
        if state.get("sizes", self.sizes_digest) != self.sizes_digest:  # (older states: none)
            raise DataError(
                "the checkpoint's data position is in shards of these names whose row groups "
                "hold other rows (their counts or their shards' sizes differ): the data was "
                "rebuilt or rewritten since the run saved it, and resumed, the run would read "
                "other documents than it had left; resume with the shards the run trained on, or "
                "train a new run from step 0 (another run.name, no checkpoint.resume)")

    # --- production -------------------------------------------------------------------------
    def _tokenize(self, texts: list[str]) -> list[np.ndarray]:
        docs = []
        for ids in self.tokenizer.encode_batch(texts):
            doc = np.empty(len(ids) + 1, dtype=np.int32)
            doc[0], doc[1:] = self.tokenizer.bos_id, ids
            docs.append(doc)
        return docs

    def _load_unit(self, epoch: int, pos: int) -> list[np.ndarray]:
        return self._tokenize(read_unit(self.units[self.epoch_units(epoch)[pos]]))

    def _batches(self, pool):
        """Generator of (batch, state after it). Runs in the producer thread."""
        epoch, cursor = self._state["epoch"], self._state["cursor"]
        buffer = BestFitBuffer()
        # Re-read the documents the saved state had buffered.
        cache: dict[tuple[int, int], list[np.ndarray]] = {}
        for e, pos, row in self._state["buffer"]:
            if (e, pos) not in cache:
                cache[(e, pos)] = self._load_unit(e, pos)
            buffer.add((e, pos, row), cache[(e, pos)][row])
        cache.clear()
        pending: OrderedDict[tuple[int, int], object] = OrderedDict()

        def schedule(e, c):  # keep `threads + 1` units in flight ahead of the cursor
            while len(pending) < self.threads + 1:
                units = self.epoch_units(e)
                if c >= len(units):
                    if not self.loop:
                        return
                    e, c = e + 1, 0
                    continue
                if (e, c) not in pending:
                    pending[(e, c)] = pool.submit(self._load_unit, e, c)
                c += 1

        exhausted = False
        while True:
            batch = np.full((self.rows, self.row_len), PAD, dtype=np.int32)
            for r in range(self.rows):
                filled = 0
                while filled < self.row_len:
                    while len(buffer) < self.buffer_docs and not exhausted:
                        if cursor >= len(self.epoch_units(epoch)):
                            if not self.loop:
                                exhausted = True
                                break
                            epoch, cursor = epoch + 1, 0
                        schedule(epoch, cursor)
                        for i, doc in enumerate(pending.pop((epoch, cursor)).result()):
                            buffer.add((epoch, cursor, i), doc)
                        cursor += 1
                    if not buffer:
                        if r == 0 and filled == 0:
                            return
                        break
                    doc, cropped = buffer.pop_best(self.row_len - filled)
                    self.cropped_tokens += cropped
                    batch[r, filled:filled + len(doc)] = doc
                    filled += len(doc)
                if not buffer and exhausted:
                    break
            state = {"epoch": epoch, "cursor": cursor, "buffer": buffer.refs()}
            yield batch, state

    def __iter__(self):
        """Yields ``[rows, T+1]`` int32 batches; prefetched by a daemon thread."""
        out: queue.Queue = queue.Queue(maxsize=max(1, self.prefetch))
        stop = threading.Event()

        def produce():
            try:
                with ThreadPoolExecutor(self.threads) as pool:
                    for item in self._batches(pool):
                        while not stop.is_set():
                            try:
                                out.put(item, timeout=0.1)
                                break
                            except queue.Full:
                                continue
                        if stop.is_set():
                            return
                out.put(None)
            except BaseException as e:  # hand the error to the consumer, with its path
                out.put(e)

        thread = threading.Thread(target=produce, daemon=True, name="xtrain-loader")
        thread.start()
        try:
            while True:
                item = out.get()
                if item is None:
                    return
                if isinstance(item, BaseException):
                    raise item
                batch, self._state = item
                yield batch
        finally:
            stop.set()
