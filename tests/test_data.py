"""Data: chunker, tokenizer, packing, host sharding, exact resume, gs:// via a local GCS server."""

from __future__ import annotations

import itertools
import json
import os
import pickle
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from tokenizers import Tokenizer as HFTokenizer

from conftest import gcs_filesystem

from xtrain.data import prepare
from xtrain.data.batches import StepBatches
from xtrain.errors import DataError
from xtrain.data.cpp_source import chunk_source, top_level_units
from xtrain.data.loader import PAD, PackedLoader, index_units, list_shards
from xtrain.data.tokenizer import BOS, load_tokenizer, save_hf, train_bpe

CPP = """#include <vector>
#define TWICE(x) \\
    ((x) * 2)
// a comment with a brace {
namespace outer {
int add(int a, int b) {
  if (a > b) { return a + b; }
  const char* s = "}";  // a brace in a string
  return a + b + '{';
}
struct Point { int x; int y; };
template <typename T>
T max3(T a, T b, T c) {
  T m = a;
  if (b > m) { m = b; }
  if (c > m) { m = c; }
  return m;
}
}  // namespace outer
int global_counter = 0;
/* block { comment */
void tick() { ++global_counter; }
"""
FUNCTIONS = ["int add(int a, int b) {", "T max3(T a, T b, T c) {", "void tick() {"]


def word_starts(text):  # a whitespace "tokenizer": one token per word
    return [m.start() for m in re.finditer(r"\S+", text)]


def test_units_partition_the_text_at_top_level():
    units = top_level_units(CPP)
    assert "".join(units) == CPP
    assert units[0] == "#include <vector>\n" and units[1].startswith("#define TWICE")
    assert any(u.strip().startswith("// a comment") and u.rstrip().endswith("// namespace outer")
               for u in units)  # the whole namespace is one unit; braces in strings/comments ignored
    # a leading comment stays with the definition it documents
    assert units[-1] == "/* block { comment */\nvoid tick() { ++global_counter; }\n"


@pytest.mark.parametrize("budget", [36, 50, 80, 1000])
def test_chunks_respect_budget_and_keep_function_bodies_whole(budget):
    starts = word_starts(CPP)
    chunks = chunk_source(CPP, starts, budget)
    for chunk in chunks:
        assert len(chunk.split()) <= budget
    for head in FUNCTIONS:  # each function (all shorter than the budgets) sits whole in one chunk
        start = CPP.index(head)
        body = CPP[start:CPP.index("\n}\n", start) + 2] if head != "void tick() {" else \
            "void tick() { ++global_counter; }"
        assert len(body.split()) <= budget  # precondition: the function fits the budget
        assert sum(body in c for c in chunks) == 1, (head, budget)
    if budget == 1000:
        assert chunks == [CPP]


def test_oversized_function_is_split_at_lines_within_budget():
    body = "void big() {\n" + "".join(f"  call_{i}(a, b);\n" for i in range(50)) + "}\n"
    chunks = chunk_source(body, word_starts(body), 30)
    assert "".join(chunks) == body and all(len(c.split()) <= 30 for c in chunks)


# --- a small synthetic corpus ----------------------------------------------------------------


def _docs(n, seed=0):
    rng = np.random.default_rng(seed)
    return [f"int f{i}() {{ return {i}; }}\n" + "x = y + z;\n" * int(rng.integers(1, 12))
            for i in range(n)]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    docs = _docs(600)
    tok, token_bytes = train_bpe(docs, 400)
    save_hf(tok, token_bytes, str(root / "tok"))
    (root / "train").mkdir()
    for s in range(3):
        table = pa.table({"text": docs[s * 200:(s + 1) * 200]})
        pq.write_table(table, root / "train" / f"shard_{s}.parquet", row_group_size=25)
    return root, docs, load_tokenizer(str(root / "tok"))


def _take(loader, n):
    out = []
    if n == 0:
        return out
    for batch in loader:
        out.append(batch.copy())
        if len(out) == n:
            break
    return out


def test_rows_start_with_bos_and_are_never_padded(corpus):
    root, _, tok = corpus
    loader = PackedLoader(str(root / "train"), tok, seq_len=48, rows=4, seed=1)
    for batch in _take(loader, 30):
        assert batch.shape == (4, 49)
        assert (batch[:, 0] == tok.bos_id).all()
        assert (batch != PAD).all() and (batch >= 0).all() and (batch < tok.vocab_size).all()


def test_hosts_are_disjoint_and_cover_the_epoch(corpus):
    root, docs, tok = corpus
    world = 3
    loaders = [PackedLoader(str(root / "train"), tok, 48, 2, seed=5, rank=r, world=world, loop=False)
               for r in range(world)]
    units = [set(l.epoch_units(0)) for l in loaders]
    assert set.union(*units) == set(range(len(loaders[0].units)))
    assert sum(len(u) for u in units) == len(loaders[0].units)  # disjoint
    # every document placed exactly once (whole or cropped): one BOS per document
    starts = [sum(int((b == tok.bos_id).sum()) for b in l) for l in loaders]
    assert sum(starts) == len(docs)
    assert starts == [25 * len(u) for u in units]


def test_one_shard_may_be_named_by_its_file(corpus):
    root, _, tok = corpus
    one = PackedLoader(str(root / "train" / "shard_1.parquet"), tok, 48, 2, loop=False)
    assert [u[0].rsplit("/", 1)[-1] for u in one.units] == ["shard_1.parquet"] * 8
    with pytest.raises(DataError, match=r"shard_9.parquet: no such directory \(nor a .parquet file\)"):
        PackedLoader(str(root / "train" / "shard_9.parquet"), tok, 48, 2)


def test_order_is_deterministic_and_seed_dependent(corpus):
    root, _, tok = corpus
    a = _take(PackedLoader(str(root / "train"), tok, 48, 2, seed=3), 5)
    b = _take(PackedLoader(str(root / "train"), tok, 48, 2, seed=3), 5)
    c = _take(PackedLoader(str(root / "train"), tok, 48, 2, seed=4), 5)
    assert len(a) == len(b) == len(c) == 5
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
    assert not all(np.array_equal(x, y) for x, y in zip(a, c, strict=True))


@pytest.mark.parametrize("k", [0, 3, 17])
def test_resume_at_step_k_is_bitwise_identical(corpus, k):
    root, _, tok = corpus
    make = lambda: PackedLoader(str(root / "train"), tok, 48, 3, seed=7, buffer_docs=40)  # noqa: E731
    uninterrupted = _take(make(), k + 20)  # spans an epoch boundary (600 docs ~ 25 batches)
    first = make()
    _take(first, k)
    state = json.loads(json.dumps(first.state_dict()))  # checkpoints carry it as JSON-able data
    resumed = make()
    resumed.load_state_dict(state)
    after = _take(resumed, 20)
    assert len(after) == len(uninterrupted[k:]) == 20
    assert all(np.array_equal(x, y) for x, y in zip(after, uninterrupted[k:], strict=True))


def test_a_position_saved_over_other_shards_or_seed_is_refused_over_moved_shards_resumed(
        corpus, tmp_path):
    """A shard added since the save would shift the shuffled order under the saved cursor (row
    groups read twice or never, or an IndexError past the end); the same shards in another
    directory are the same data."""
    root, _, tok = corpus
    first = PackedLoader(str(root / "train"), tok, 48, 3, seed=7)
    _take(first, 4)
    state = json.loads(json.dumps(first.state_dict()))
    moved, grown = tmp_path / "moved", tmp_path / "grown"
    shutil.copytree(root / "train", moved)
    shutil.copytree(root / "train", grown)
    shutil.copy(root / "train" / "shard_0.parquet", grown / "shard_3.parquet")
    resumed = PackedLoader(str(moved), tok, 48, 3, seed=7)
    resumed.load_state_dict(state)
    assert all(np.array_equal(x, y) for x, y in zip(_take(resumed, 3), _take(first, 3), strict=True))
    with pytest.raises(DataError, match=r"the checkpoint's data position counts 24 row groups of "
                                        r"other shards than this data's 32: resumed, it would read"):
        PackedLoader(str(grown), tok, 48, 3, seed=7).load_state_dict(state)
    with pytest.raises(DataError, match=r"data position is for seed 7 on process 0 of 1, this "
                                        r"run's loader for seed 8 on process 0 of 1: resume with "
                                        r"the trainer.seed"):
        PackedLoader(str(moved), tok, 48, 3, seed=8).load_state_dict(state)
    # rebuilt under the same names, as a corpus build replaces its own: other documents in row
    # groups of the same count (the cursor would land on other rows; past a shorter one, an
    # IndexError)
    rebuilt = tmp_path / "rebuilt"
    rebuilt.mkdir()
    docs = [d + " // rebuilt" for d in _docs(600)][::-1]
    for i in range(3):
        pq.write_table(pa.table({"text": docs[i * 200:(i + 1) * 200]}),
                       rebuilt / f"shard_{i}.parquet", row_group_size=25)
    with pytest.raises(DataError, match=r"the checkpoint's data position is in shards of these "
                                        r"names whose row groups hold other rows"):
        PackedLoader(str(rebuilt), tok, 48, 3, seed=7).load_state_dict(state)
    old_state = {k: v for k, v in state.items() if k != "sizes"}  # a checkpoint of before
    PackedLoader(str(moved), tok, 48, 3, seed=7).load_state_dict(old_state)


@pytest.mark.parametrize("k", [1, 4, 6])
def test_overfitting_resumes_on_the_same_repeated_batches_in_order(corpus, k):
    root, _, tok = corpus
    repeat = 3

    def steps():
        return StepBatches(PackedLoader(str(root / "train"), tok, 48, 2, seed=7), accum=2,
                           repeat=repeat)

    uninterrupted = list(itertools.islice(steps(), k + 5))
    # the first `repeat` steps, then them again, in order
    assert all(torch.equal(uninterrupted[i][0], uninterrupted[i % repeat][0])
               for i in range(k + 5))
    assert not torch.equal(uninterrupted[0][0], uninterrupted[1][0])
    state = json.loads(json.dumps(uninterrupted[k - 1][1]))  # as a checkpoint carries it
    resumed = steps()
    resumed.load_state_dict(state)
    after = [tokens for tokens, _ in itertools.islice(resumed, 5)]
    assert all(torch.equal(x, y) for x, (y, _) in zip(after, uninterrupted[k:], strict=True))


def test_gs_path_gives_the_same_batches_as_local(corpus, gcs_bucket):
    root, _, tok = corpus
    bucket, _ = gcs_bucket
    fs = gcs_filesystem(bucket)
    for shard in sorted((root / "train").iterdir()):
        fs.put_file(str(shard), f"{bucket}/data/train/{shard.name}")
    local = _take(PackedLoader(str(root / "train"), tok, 48, 2, seed=2), 8)
    remote = _take(PackedLoader(f"{bucket}/data/train", tok, 48, 2, seed=2), 8)
    assert len(local) == len(remote) == 8
    assert all(np.array_equal(x, y) for x, y in zip(local, remote, strict=True))


# --- bad input -------------------------------------------------------------------------------


def test_missing_and_empty_dirs_are_named(tmp_path, corpus):
    tok = corpus[2]
    with pytest.raises(DataError, match="no such directory"):
        PackedLoader(str(tmp_path / "nope"), tok, 16, 1)
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="no parquet shards found"):
        PackedLoader(str(tmp_path / "empty"), tok, 16, 1)


def test_corrupt_shard_and_missing_column_fail_before_training(tmp_path, corpus):
    tok = corpus[2]
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "a.parquet").write_bytes(b"this is not parquet")
    with pytest.raises(DataError, match=r"a\.parquet: not a readable parquet file"):
        PackedLoader(str(tmp_path / "bad"), tok, 16, 1)
    (tmp_path / "nocol").mkdir()
    pq.write_table(pa.table({"content": ["x"]}), tmp_path / "nocol" / "b.parquet")
    with pytest.raises(DataError, match=r"b\.parquet: no 'text' column"):
        PackedLoader(str(tmp_path / "nocol"), tok, 16, 1)


def test_corrupt_shard_met_mid_epoch_is_reported_with_its_path(tmp_path, corpus):
    root, docs, tok = corpus
    shard = tmp_path / "s.parquet"
    pq.write_table(pa.table({"text": docs[:100]}), shard, row_group_size=50, compression="snappy")
    loader = PackedLoader(str(tmp_path), tok, 48, 2, shuffle=False, threads=1)  # footer is fine
    raw = bytearray(shard.read_bytes())
    raw[4:400] = b"\xff" * 396  # damage the first row group's pages, keep the footer
    shard.write_bytes(bytes(raw))
    with pytest.raises(DataError, match=r"s\.parquet: failed reading row group 0"):
        _take(loader, 5)


def test_tokenizer_vocab_must_match_the_config(corpus, compose_config):
    root = corpus[0]
    cfg = compose_config()
    cfg.data.build_sources = []
    cfg.data.tokenizer = str(root / "tok")
    with pytest.raises(DataError, match="has 400 tokens but data.vocab_size=4096"):
        prepare(cfg.data)


def test_the_smallest_vocab_size_allowed_is_the_smallest_tokenizer_xtrain_trains():
    """data.vocab_size's lower bound (checked at once, before a corpus is built) is the byte-level
    BPE's floor: every byte and the special tokens, before any merge."""
    from dataclasses import fields

    from xtrain.config import DataConfig
    from xtrain.data.tokenizer import SPECIAL_TOKENS

    (vocab,) = [f for f in fields(DataConfig) if f.name == "vocab_size"]
    floor = vocab.metadata["bounds"]["ge"]
    tok, _ = train_bpe(["int main() { return 0; }"] * 4, floor)
    assert floor == 256 + len(SPECIAL_TOKENS) == tok.get_vocab_size()


def test_no_cpp_sources_is_a_clear_error(tmp_path, compose_config):
    cfg = compose_config()
    (tmp_path / "nothing-here").mkdir()  # (one that does not exist: tests/test_refusals.py)
    cfg.data.build_sources = [str(tmp_path / "nothing-here")]
    cfg.data.build_dir = str(tmp_path / "build")
    with pytest.raises(DataError, match="no C/C\\+\\+ sources found"):
        prepare(cfg.data)


def test_tokenizer_has_bos_and_byte_lengths(corpus):
    root, _, tok = corpus
    hf = HFTokenizer.from_file(str(root / "tok" / "tokenizer.json"))
    assert tok.bos_id == hf.token_to_id(BOS) and tok.token_bytes[tok.bos_id] == 0
    text = "int f1() { return 1; }\n"
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert int(tok.token_bytes[ids].sum()) == len(text.encode())


@pytest.mark.parametrize("token_bytes, found", [
    (torch.ones(399, dtype=torch.int32), "expected 400 byte lengths .*found 399"),
    (torch.ones(1, 400, dtype=torch.int32), r"expected 400 .*found an array of shape \(1, 400\)"),
    ({"sizes": torch.ones(400)}, "holds a dict, not a tensor of byte lengths"),
    (torch.ones(400, dtype=torch.bfloat16), "holds torch.bfloat16 values, not whole byte lengths"),
    (torch.ones(400, requires_grad=True), "holds torch.float32 values, not whole byte lengths"),
])
def test_token_bytes_of_another_vocabulary_are_refused_at_load(corpus, tmp_path, token_bytes, found):
    """Validation indexes token_bytes by every target id: a short one failed there, at the end of
    a training run, after its last checkpoint."""
    directory = tmp_path / "tok"
    shutil.copytree(corpus[0] / "tok", directory)
    torch.save(token_bytes, directory / "token_bytes.pt")
    with pytest.raises(DataError, match=rf"^{directory}/token_bytes.pt: .*{found}"):
        load_tokenizer(str(directory))


def _half(path) -> bytes:
    data = path.read_bytes()
    return data[:len(data) // 2]


@pytest.mark.parametrize("name, damage, reason", [
    ("tokenizer.json", _half, r"not a readable tokenizer \(JSONDecodeError: "),
    ("tokenizer.json", lambda _: b"\xff\xfe{}", r"not a readable tokenizer \(UnicodeDecodeError: "),
    ("tokenizer.json", lambda _: b'{"model": {"type": "BPE"}}', r"not a readable tokenizer \("),
    ("token_bytes.pt", _half, r"not a saved tensor \(PytorchStreamReader failed"),
    ("token_bytes.pt", lambda _: b"garbage", r"not a saved tensor \("),
    ("token_bytes.pt", lambda _: pickle.dumps(_Payload("/nonexistent/x"), protocol=2), r"not a saved tensor \("),
])
def test_a_damaged_tokenizer_file_is_refused_naming_it(corpus, tmp_path, name, damage, reason):
    """A truncated copy, a foreign file: one line naming the file and why (it was a JSON or
    unpickling traceback, torch's advising weights_only=False, wrong for an untrusted file)."""
    directory = tmp_path / "tok"
    shutil.copytree(corpus[0] / "tok", directory)
    (directory / name).write_bytes(damage(directory / name))
    with pytest.raises(DataError, match=rf"^{directory}/{name}: {reason}") as refused:
        load_tokenizer(str(directory))
    assert "weights_only" not in str(refused.value) and "\n" not in str(refused.value)


def test_a_nanochat_tokenizer_without_bos_is_refused_naming_it(tmp_path):
    import tiktoken

    enc = tiktoken.Encoding("t", pat_str=r"\S+|\s+", mergeable_ranks={bytes([i]): i for i in range(256)},
                            special_tokens={"<|endoftext|>": 256})
    with pytest.raises(DataError, match=rf"^{tmp_path}/tokenizer.pkl: has no <\|bos\|> token"):
        load_tokenizer(_nanochat_dir(tmp_path, pickle.dumps(enc)))


def test_xtrain_bpe_encodes_through_tiktoken_with_the_same_ids(compose_config):
    """The loader encodes xtrain's HF-trained BPE with tiktoken (faster): it must give HF's ids
    for every document of the default corpus, and for text outside it."""
    cfg = compose_config()
    tok = prepare(cfg.data)
    assert tok.kind == "tiktoken"
    hf = HFTokenizer.from_file(f"{cfg.data.tokenizer}/tokenizer.json")
    texts = []
    for shard in list_shards(cfg.data.train_files):
        texts += pq.read_table(shard, columns=["text"]).column("text").to_pylist()
    texts.append("naïve ünïcode — 😀 \t\r\n  trailing   spaces  \n\n'll 've 're 123 x1 \x00\x7f")
    expected = [e.ids for e in hf.encode_batch(texts, add_special_tokens=False)]
    assert tok.encode_batch(texts) == expected
    assert sum(map(len, expected)) > 1_000_000  # the whole corpus, not a sample
    assert tok.decode(expected[-1]) == texts[-1]


def test_other_hf_tokenizers_stay_on_hf(tmp_path):
    from tokenizers import Tokenizer as HFTok
    from tokenizers import models, pre_tokenizers, trainers

    hf = HFTok(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)  # not a plain byte-level BPE
    hf.train_from_iterator(_docs(50), trainers.BpeTrainer(vocab_size=300, special_tokens=[BOS]))
    save_hf(hf, np.ones(hf.get_vocab_size(), dtype=np.int32), str(tmp_path))
    tok = load_tokenizer(str(tmp_path))
    assert tok.kind == "hf" and tok.encode("int x;") == hf.encode("int x;").ids


def _nanochat_dir(path, payload) -> str:
    """A nanochat tokenizer directory whose tokenizer.pkl is ``payload`` (bytes)."""
    import torch

    (path / "tokenizer.pkl").write_bytes(payload)
    torch.save(torch.tensor([1] * 256 + [0], dtype=torch.int32), path / "token_bytes.pt")
    return str(path)


def _byte_encoding():
    import tiktoken

    ranks = {bytes([i]): i for i in range(256)}
    return tiktoken.Encoding("t", pat_str=r"\S+|\s+", mergeable_ranks=ranks, special_tokens={BOS: 256})


@pytest.mark.parametrize("protocol", [2, pickle.DEFAULT_PROTOCOL])
def test_nanochat_tiktoken_directory_loads(tmp_path, protocol):
    tok = load_tokenizer(_nanochat_dir(tmp_path, pickle.dumps(_byte_encoding(), protocol=protocol)))
    assert tok.kind == "tiktoken" and tok.bos_id == 256 and tok.vocab_size == 257
    assert tok.decode(tok.encode("abc")) == "abc"


class _Payload:
    """What a hostile tokenizer.pkl holds: unpickling it calls os.system."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_a_tokenizer_pickle_carrying_code_is_refused_without_running_it(tmp_path):
    marker = tmp_path / "ran"
    assert pickle.loads(pickle.dumps(_Payload(marker))) == 0 and marker.exists()  # it does run
    marker.unlink()
    state = _byte_encoding().__getstate__()
    state["special_tokens"] = {BOS: _Payload(marker)}
    hostile = {"alone": pickle.dumps(_Payload(marker)),
               # inside an Encoding's state, where tiktoken's __setstate__ would receive it
               "inside": _pickled_encoding(state)}
    for name, payload in hostile.items():
        directory = tmp_path / name
        directory.mkdir()
        with pytest.raises(DataError, match=r"tokenizer.pkl: refused.*(posix|os)\.system"):
            load_tokenizer(_nanochat_dir(directory, payload))
        assert not marker.exists(), name


def _pickled_encoding(state) -> bytes:
    """A pickle of tiktoken.core.Encoding holding ``state``, as ``pickle.dump(encoding)`` writes."""
    enc = _byte_encoding()
    enc.__getstate__ = lambda: state  # pickle asks the instance for its state
    return pickle.dumps(enc)


def test_a_tokenizer_pickle_naming_a_registered_encoding_is_refused(tmp_path):
    # tiktoken pickles its registered encodings by name, and unpickles them by downloading
    payload = _pickled_encoding("cl100k_base")
    with pytest.raises(DataError, match="not a tiktoken Encoding's"):
        load_tokenizer(_nanochat_dir(tmp_path, payload))


def test_default_corpus_builds_once_and_rebuilds_when_sources_change(tmp_path, compose_config):
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.cpp").write_text(CPP)
    (src / "b.hpp").write_text("namespace b { inline int g() { return 2; } }\n")
    (src / "b_copy.hpp").write_text("namespace b { inline int g() { return 2; } }\n")
    cfg = compose_config(["data.vocab_size=300"])
    cfg.data.build_sources = [str(src)]
    cfg.data.build_dir = str(tmp_path / "build")
    logs = []
    prepare(cfg.data, log=logs.append)
    manifest = json.loads((tmp_path / "build" / "manifest.json").read_text())
    assert manifest["files"] == 3 and manifest["duplicates_dropped"] == 1  # the copied header
    prepare(cfg.data, log=logs.append)
    assert len(logs) == 1  # reused
    older = json.loads((tmp_path / "build" / "manifest.json").read_text())  # as builds before
    older["build_key"] = older.pop("build_hash")  # 2026-12 named its inputs' hash
    (tmp_path / "build" / "manifest.json").write_text(json.dumps(older))
    prepare(cfg.data, log=logs.append)
    assert len(logs) == 1  # reused too
    # named to sort second: of four files the seed holds out the third, b.hpp here (a c.cc made
    # it b.hpp's copy, which leaves validation no chunk: a build refused)
    (src / "a2.cc").write_text("int h() { return 3; }\n")
    prepare(cfg.data, log=logs.append)
    assert len(logs) == 2 and json.loads((tmp_path / "build" / "manifest.json").read_text())["files"] == 4


def test_validation_on_training_shards_of_a_corpus_built_on_first_use_is_refused(tmp_path, compose_config):
    """Its shards exist once built: refused then (xtrain.data.prepare), and before anything else
    by the input checks when the build is already in place."""
    from xtrain.inputs import check_data

    src = tmp_path / "src"
    src.mkdir()
    (src / "a.cpp").write_text(CPP)
    (src / "b.hpp").write_text("namespace b { inline int g() { return 2; } }\n")
    cfg = compose_config(["data.vocab_size=300", f"data.build_dir={tmp_path / 'build'}",
                          "data.val_files=${data.build_dir}/train"])
    cfg.data.build_sources = [str(src)]
    check_data(cfg.data)  # nothing built yet: no shards to compare
    shared = re.escape(f"data.val_files={tmp_path / 'build'}/train: 1 shard(s) also in data.train_files")
    with pytest.raises(DataError, match=shared):
        prepare(cfg.data, log=lambda _: None)
    with pytest.raises(DataError, match=shared):
        check_data(cfg.data)
    cfg.data.val_files = "${data.build_dir}/val"
    check_data(cfg.data)
    prepare(cfg.data, log=lambda _: None)


def test_a_build_with_a_split_left_empty_or_too_small_a_vocabulary_is_refused_writing_nothing(
        tmp_path, capsys):
    """Two identical files leave validation's copy only (chunks are de-duplicated across the
    splits), and a blank file held out leaves validation nothing; three tiny files cannot give
    4096 tokens. Each is refused at the build, naming what to change, before anything is written:
    a run would fail on it later, less clearly. The corpus CLI names its own arguments, not a
    training's config fields."""
    from xtrain.data.__main__ import main
    from xtrain.data.corpus import BuildSpec, ensure_built

    twins = tmp_path / "twins"
    twins.mkdir()
    for name in ("a.hpp", "b.hpp"):
        (twins / name).write_text(CPP)
    with pytest.raises(DataError, match=r"no training chunk left \(2 files, 1 held out for "
                                        r"validation, \d+ duplicate chunks dropped\)"):
        ensure_built(BuildSpec([str(twins)], str(tmp_path / "out-twins"), 300, 256))
    # the same seed holds out the first of two files: here a blank one, which gives no chunk
    (twins / "a.hpp").write_text("\n")
    with pytest.raises(DataError, match=r"no validation chunk left \(2 files, 1 held out for "
                                        r"validation, 0 duplicate chunks dropped\)"):
        ensure_built(BuildSpec([str(twins)], str(tmp_path / "out-twins"), 300, 256))
    small = _sources(tmp_path)
    with pytest.raises(DataError, match=r"these sources give a vocabulary of \d+ tokens, fewer "
                                        r"than data.vocab_size=4096: name more sources, or set "
                                        r"data.vocab_size=\d+ or less"):
        ensure_built(BuildSpec([str(small)], str(tmp_path / "out-small"), 4096, 256))
    (tmp_path / "empty").mkdir()
    for sources, refusal in [(small, r"these sources give a vocabulary of \d+ tokens, fewer than "
                                     r"--vocab-size 4096: name more sources, or set --vocab-size "
                                     r"\d+ or less"),
                             (tmp_path / "empty", "no C/C\\+\\+ sources found"),
                             (tmp_path / "missing", ".*missing does not exist")]:
        with pytest.raises(SystemExit) as exit_:
            main(["build", str(sources), "--out", str(tmp_path / "out-cli"), "--vocab-size", "4096"])
        err = capsys.readouterr().err
        assert exit_.value.code == 2, err
        assert re.fullmatch(rf"xtrain: data error: sources \['{re.escape(str(sources))}'\]: "
                            rf"{refusal}.*\n", err), err
    assert not (tmp_path / "out-twins" / "manifest.json").exists()
    assert not (tmp_path / "out-small" / "manifest.json").exists()


def test_sources_count_symlinked_files_and_never_binary_ones(tmp_path):
    """A tree may link headers in from elsewhere; an object file named like a header is no C++."""
    from xtrain.data.cpp_source import find_sources

    src = _sources(tmp_path)
    elsewhere = tmp_path / "elsewhere.hpp"
    elsewhere.write_text("inline int e() { return 5; }\n")
    (src / "linked.hpp").symlink_to(elsewhere)
    (src / "blob.h").write_bytes(b"\x7fELF\x02\x01\x01\0\0\0int x;")
    (src / "loop").symlink_to(src)  # (a link to a directory is not followed)
    assert [url.rsplit("/", 1)[-1] for url, _ in find_sources([str(src)])] == [
        "a.cpp", "linked.hpp", "b.hpp"]


def test_extensionless_files_count_as_cpp_only_when_they_open_like_a_header(tmp_path):
    """Headers without a suffix (libstdc++'s, Qt's) are C++; a Makefile or README that mentions
    ``#include`` and ``namespace`` in its text is not."""
    from xtrain.data.cpp_source import find_sources

    src = tmp_path / "src"
    src.mkdir()
    headers = {"vector": "// <vector> -*- C++ -*-\n#include <bits/stl_vector.h>\n",
               "QString": '\ufeff#include "qstring.h"\n',
               "config": "\n/*\n * Copyright\n */\n#ifndef CONFIG\n#define CONFIG\n#endif\n"}
    others = {"Makefile": "# Build with g++ // the default\nall:\n\tg++ -o x a.cpp\n# #include paths\n",
              "README": "Write #include <x> and use namespace y; see /* comments */.\n",
              "build": "#!/bin/sh\n# #pragma once is used by every header\n",
              "rules": "# include this file from the top Makefile; #define nothing here\n"}
    for name, text in {**headers, **others}.items():
        (src / name).write_text(text)
    assert sorted(url.rsplit("/", 1)[-1] for url, _ in find_sources([str(src)])) == sorted(headers)


def _sources(tmp_path):
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "a.cpp").write_text(CPP)
    (src / "sub" / "b.hpp").write_text("namespace b { inline int g() { return 2; } }\n")
    return src


def _no_reading_or_training(monkeypatch):
    """A refusal must come before the sources are read and the tokenizer is trained."""
    import xtrain.data.corpus
    import xtrain.data.tokenizer

    def forbidden(*_):
        raise AssertionError("sources read or tokenizer trained before the refusal")

    monkeypatch.setattr(xtrain.data.corpus, "find_sources", forbidden)
    monkeypatch.setattr(xtrain.data.tokenizer, "train_bpe", forbidden)


def test_a_foreign_output_directory_is_refused_untouched_before_building(tmp_path, monkeypatch,
                                                                          capsys, compose_config):
    from xtrain.data.__main__ import main
    from xtrain.inputs import check_data

    src, out = _sources(tmp_path), tmp_path / "mydata"
    (out / "notes").mkdir(parents=True)
    (out / "important.txt").write_text("keep me")
    (out / "notes" / "n.txt").write_text("and me")
    (tmp_path / "afile").write_text("a file")
    before, names = _tree(tmp_path), sorted(p.name for p in tmp_path.iterdir())
    _no_reading_or_training(monkeypatch)
    refusal = rf"{re.escape(str(out))} is not an xtrain corpus build .*holds important\.txt, notes"
    with pytest.raises(SystemExit) as exit_:  # python -m xtrain.data build SRC --out DIR
        main(["build", str(src), "--out", str(out), "--vocab-size", "300"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and re.search(refusal, err) and "choose a new or empty" in err
    cfg = compose_config(["data.vocab_size=300"])
    cfg.data.build_sources, cfg.data.build_dir = [str(src)], str(out)
    with pytest.raises(DataError, match=refusal):  # training: the early input check
        check_data(cfg.data)
    with pytest.raises(DataError, match=refusal):  # training: the build itself
        prepare(cfg.data)
    cfg.data.build_dir = str(tmp_path / "afile")
    with pytest.raises(DataError, match="afile is not an xtrain corpus build .* is a file"):
        prepare(cfg.data)
    assert _tree(tmp_path) == before and sorted(p.name for p in tmp_path.iterdir()) == names


@pytest.mark.parametrize("args, refusal", [
    (["--vocab-size", "10"], "--vocab-size 10: must be >= 257 (a byte-level BPE's 256 bytes and <|bos|>)"),
    (["--vocab-size", "-5"], "--vocab-size -5: must be >= 257"),
    (["--chunk-tokens", "0"], "--chunk-tokens 0: must be >= 1"),
    (["--val-fraction", "2"], "--val-fraction 2: must be > 0 and < 1 (the share of files held out"),
    (["--val-fraction", "0", "--chunk-tokens", "0"], "--chunk-tokens 0: must be >= 1; --val-fraction 0: "),
    (["--out-under-a-file"], "corpus output directory {tmp_path}/afile/corpus cannot be written: "),
])
def test_the_corpus_builder_refuses_bad_arguments_before_reading_sources(tmp_path, monkeypatch, capsys,
                                                                        args, refusal):
    """``python -m xtrain.data build``: the ranges a training's build is held to, in one line and
    exit 2 before a source is read (values out of them built a corpus of nothing, a traceback for
    a negative vocabulary or an output it cannot write)."""
    from xtrain.data.__main__ import main

    src = _sources(tmp_path)
    (tmp_path / "afile").write_text("a file where a directory would go")
    out = tmp_path / ("afile" if args == ["--out-under-a-file"] else "built") / "corpus"
    _no_reading_or_training(monkeypatch)
    with pytest.raises(SystemExit) as exit_:
        main(["build", str(src), "--out", str(out)] + [a for a in args if a != "--out-under-a-file"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.startswith("xtrain: data error: " + refusal.format(tmp_path=tmp_path)), err
    assert len(err.splitlines()) == 1 and not (tmp_path / "built").exists()


@pytest.mark.parametrize("where", ["src", "src/sub", "src/new", ".", "link"])
def test_an_output_directory_overlapping_the_sources_is_refused(tmp_path, monkeypatch, where,
                                                                compose_config):
    src = _sources(tmp_path)
    (tmp_path / "link").symlink_to(src)  # another spelling of the source directory
    before = _tree(src)
    _no_reading_or_training(monkeypatch)
    relation = {"src": "is", "link": "is", ".": "contains"}.get(where, "is inside")
    cfg = compose_config(["data.vocab_size=300"])
    cfg.data.build_sources, cfg.data.build_dir = [str(src)], str(tmp_path / where)
    with pytest.raises(DataError, match=rf" {relation} the source directory {re.escape(str(src))}"):
        prepare(cfg.data)
    assert _tree(src) == before and not (tmp_path / "src" / "new").exists()
    assert not list(tmp_path.glob("*.lock")) and not list(src.glob("*.lock"))


@pytest.mark.parametrize("out, relation", [(".", "is"), ("./", "is"), ("..", "contains")])
def test_an_output_directory_holding_the_working_directory_is_refused(tmp_path, monkeypatch, capsys,
                                                                      out, relation):
    """A build replaces its output directory: it would take the working directory with it (and
    `--out .` found its own lock file there, `..lock`, and refused the directory as not empty)."""
    from xtrain.data.__main__ import main

    src = _sources(tmp_path)
    (tmp_path / "work").mkdir()
    monkeypatch.chdir(tmp_path / "work")
    _no_reading_or_training(monkeypatch)
    with pytest.raises(SystemExit) as exit_:
        main(["build", str(src), "--out", out])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err == (f"xtrain: data error: corpus output directory {out} "
                                             f"{relation} the working directory: a build replaces its "
                                             "output directory; choose a new directory (--out, or "
                                             "data.build_dir)\n"), err
    assert not list((tmp_path / "work").iterdir()) and not list(tmp_path.glob("*.lock"))


def test_a_finished_build_in_a_place_not_writable_is_reused_and_a_new_one_refused(tmp_path, monkeypatch,
                                                                                   compose_config):
    """A corpus built once and shared read-only is read, not refused for want of write access;
    a build that has yet to be made there is refused before a source is read. (os.access is
    replaced: this suite runs as root, whom permission bits do not stop.)"""
    import xtrain.data.corpus
    from xtrain.data.corpus import BuildSpec, check_output, ensure_built

    src, out = _sources(tmp_path), tmp_path / "shared" / "corpus"
    spec = BuildSpec(sources=[str(src)], out_dir=str(out), vocab_size=300, chunk_tokens=2048)
    built = ensure_built(spec)
    monkeypatch.setattr(xtrain.data.corpus.os, "access", lambda path, mode: mode != os.W_OK)
    assert ensure_built(spec) == built
    with pytest.raises(DataError, match=f"corpus output directory {re.escape(str(tmp_path))}/shared/other "
                                        f"cannot be written: {re.escape(str(tmp_path))}/shared is not writable"):
        check_output([str(src)], str(tmp_path / "shared" / "other"))


def test_a_build_into_a_bucket_not_writable_is_refused_before_a_source_is_read(tmp_path, monkeypatch):
    """A remote data.build_dir is probed with a file written and removed: a bucket that refuses
    writes is said at start, not after every source is read and the BPE trained. (The store's
    write is made to fail as GCS's 403 does: neither the emulator nor memory:// has
    permissions.)"""
    import fsspec

    from xtrain.data.corpus import check_output

    memory, src = fsspec.filesystem("memory"), str(_sources(tmp_path))

    def forbidden(path, *args, **kwargs):
        raise PermissionError(f"403 Forbidden: {path}")

    monkeypatch.setattr(memory, "pipe_file", forbidden)
    with pytest.raises(DataError, match=r"corpus output directory memory://ro-bucket/corpus cannot be "
                                        r"written: PermissionError: 403 Forbidden: /ro-bucket/corpus/"):
        check_output([src], "memory://ro-bucket/corpus")
    monkeypatch.undo()
    check_output([src], "memory://rw-bucket/corpus")
    assert memory.ls("/rw-bucket/corpus") == []  # (the probe removed)
    memory.pipe("/rw-bucket/corpus/.write-probe-otherhost-7", b"")  # another build's, checking
    check_output([src], "memory://rw-bucket/corpus")  # (not a file in the way)


def test_stale_and_partial_builds_of_xtrains_own_are_still_replaced(tmp_path, compose_config):
    from xtrain.data.corpus import BUILD_MARKER, BuildSpec, ensure_built

    src, out = _sources(tmp_path), tmp_path / "build"
    cfg = compose_config(["data.vocab_size=300"])
    cfg.data.build_sources, cfg.data.build_dir = [str(src)], str(out)
    out.mkdir()  # an empty directory is built into
    prepare(cfg.data)
    (out / BUILD_MARKER).unlink()  # a build by a version before the marker: its manifest says so
    (out / "stray.txt").write_text("left in a build directory")
    leftover = tmp_path / f"build.building-{os.getpid()}"  # a killed build by an earlier process
    (leftover / "train").mkdir(parents=True)
    cfg.data.vocab_size = 320
    built = []
    prepare(cfg.data, log=built.append)
    assert built and json.loads((out / "manifest.json").read_text())["vocab_size"] == 320
    assert not (out / "stray.txt").exists() and (out / BUILD_MARKER).exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["build", "build.lock", "src"]
    # in place (an object store): a build killed before its manifest holds the marker
    import fsspec

    mem = fsspec.filesystem("memory")
    root = f"/xtrain-test-{os.getpid()}"
    mem.pipe(f"{root}/src/a.cpp", CPP.encode())
    mem.pipe(f"{root}/src/b.hpp", b"namespace b { inline int g() { return 2; } }\n")
    mem.pipe(f"{root}/out/{BUILD_MARKER}", b"{}")
    mem.pipe(f"{root}/out/train/shard_00000.parquet", b"half written")
    mem.pipe(f"{root}/foreign/keep.txt", b"keep")
    sources = [f"memory://{root}/src"]
    try:
        manifest = ensure_built(BuildSpec(sources, f"memory://{root}/out", 300, 256))
        shard = pq.read_table(mem.open(f"{root}/out/train/shard_00000.parquet", "rb"))
        assert manifest["files"] == 2 and shard.num_rows > 0
        with pytest.raises(DataError, match="holds keep.txt"):
            ensure_built(BuildSpec(sources, f"memory://{root}/foreign", 300, 256))
        assert mem.cat(f"{root}/foreign/keep.txt") == b"keep"
    finally:
        mem.rm(root, recursive=True)


def test_builders_of_the_same_inputs_on_an_object_store_never_delete_each_others_files(monkeypatch):
    """A build on an object store is written in place (no rename there). Two sweep jobs building
    one gs:// corpus: the second to finish learning its tokenizer cleared the directory while the
    first wrote it, or after the first had started training on it. Here the first (A) is caught
    just before its manifest, its last write; the second (B) then builds."""
    import fsspec

    from xtrain.data.corpus import BuildSpec, ensure_built

    mem, root = fsspec.filesystem("memory"), f"/xtrain-race-{os.getpid()}"
    mem.pipe(f"{root}/src/a.cpp", CPP.encode())
    mem.pipe(f"{root}/src/b.hpp", b"namespace b { inline int g() { return 2; } }\n")
    spec = BuildSpec([f"memory://{root}/src"], f"memory://{root}/out", 300, 256)
    try:
        ensure_built(spec)
        built = {path: mem.cat(path) for path in mem.find(f"{root}/out")}
        mem.rm(f"{root}/out/manifest.json")  # A, writing its last file
        removed, rm = [], mem.rm
        monkeypatch.setattr(mem, "rm", lambda path, *a, **k: (removed.append(path), rm(path, *a, **k)))
        ensure_built(spec)  # B
        assert [path for path in removed if ".write-probe-" not in path] == []  # (B's own probe)
        assert {path: mem.cat(path) for path in mem.find(f"{root}/out")} == built  # the same bytes
    finally:
        mem.rm(root, recursive=True)


def test_a_build_dir_given_as_a_file_url_or_a_symlink_is_built_where_it_points(tmp_path):
    """``file:///x`` is the local path /x (not ./file:/x), and a build dir that is a symlink to a
    bigger disk is built on that disk, the link left in place (it was renamed aside, and its
    removal then failed with a traceback)."""
    from xtrain.data.corpus import BuildSpec, ensure_built

    src = _sources(tmp_path)
    url_dir = tmp_path / "by_url"
    ensure_built(BuildSpec([str(src)], f"file://{url_dir}", 300, 256))
    assert (url_dir / "manifest.json").exists() and not Path("file:").exists()
    disk, link = tmp_path / "big_disk" / "corpus", tmp_path / "corpus"
    disk.mkdir(parents=True)
    link.symlink_to(disk)
    ensure_built(BuildSpec([str(src)], str(link), 300, 256))
    assert link.is_symlink() and (disk / "manifest.json").exists()
    assert sorted(p.name for p in disk.parent.iterdir()) == ["corpus", "corpus.lock"]


def test_a_character_of_more_tokens_than_the_budget_stays_whole():
    """'日' as 3 byte tokens under a budget of 2: its own chunk, not an endless split."""
    assert chunk_source("a日b", [0, 1, 1, 1, 2], 2) == ["a", "日", "b"]


def test_last_shard_held_out_for_validation(corpus, compose_config):
    from xtrain.train.loaders import build_loaders

    root, _, tok = corpus
    cfg = compose_config(["model.sequence_len=48"])
    cfg.data.train_files, cfg.data.holdout_last_shard = str(root / "train"), True
    loaders = build_loaders(cfg.data, cfg.trainer, 48, tok, rows=2, accum=1)
    train_shards = {u[0] for u in loaders.steps.loader.units}
    val_shards = {u[0] for u in loaders.val.loader.units}
    assert len(train_shards) == 2 and val_shards == {str(root / "train" / "shard_2.parquet")}


def test_holding_out_the_last_shard_of_a_build_of_one_shard_is_refused(tmp_path, compose_config):
    """A corpus built on first use is checked only once built: a small build writes one train
    shard, and holdout_last_shard then left training none (an IndexError in the loader)."""
    from xtrain.train.loaders import build_loaders

    cfg = compose_config(["data.vocab_size=300", "data.holdout_last_shard=true", "data.val_files=null"])
    cfg.data.build_sources, cfg.data.build_dir = [str(_sources(tmp_path))], str(tmp_path / "build")
    tok = prepare(cfg.data)
    with pytest.raises(DataError, match=r"data.train_files=.*/build/train: holdout_last_shard needs "
                                        r"at least 2 shards, found 1"):
        build_loaders(cfg.data, cfg.trainer, 48, tok, rows=2, accum=1)


def test_one_evaluation_reads_each_validation_document_once(corpus, compose_config):
    """The held-out shard (200 documents, fewer than the loader buffers) with more evaluation
    batches than it fills: each document starts a row once; the last batch is padded, never
    refilled from the split's start."""
    from xtrain.train.loaders import build_loaders

    root, docs, tok = corpus
    cfg = compose_config(["model.sequence_len=48", "trainer.eval_tokens=96000"])
    cfg.data.train_files, cfg.data.holdout_last_shard = str(root / "train"), True
    loaders = build_loaders(cfg.data, cfg.trainer, 48, tok, rows=2, accum=1)
    batches = [b.numpy() for b in loaders.val]
    assert sum(int((b == tok.bos_id).sum()) for b in batches) == len(docs[400:600])
    assert (batches[-1] == PAD).any() and not any((b == PAD).any() for b in batches[:-1])


def test_validation_scores_the_same_sequences_whatever_the_batch_and_process_count(corpus, compose_config):
    """trainer.eval_tokens (here 5 sequences of 48, rounded up) picks the rows scored, not the
    batch count: 2 rows per batch (the last batch's second row PAD), 3 rows, and 4 rows kept 2
    per process by two processes all score the split's first 5 rows, each once."""
    from xtrain.train.loaders import build_loaders

    root, _, tok = corpus
    cfg = compose_config(["model.sequence_len=48", "trainer.eval_tokens=230"])
    cfg.data.train_files, cfg.data.holdout_last_shard = str(root / "train"), True

    def scored(rows, host_rows=slice(None)):
        val = build_loaders(cfg.data, cfg.trainer, 48, tok, rows=rows, accum=1, host_rows=host_rows).val
        batches = [b.numpy() for b in val]
        assert len(batches) == val.batches == -(-5 // rows)
        return [row.tolist() for b in batches for row in b if (row != PAD).any()]

    first = scored(2)
    assert len(first) == 5 and all(row[0] == tok.bos_id for row in first)
    assert scored(3) == first
    by_process = [scored(4, slice(0, 2)), scored(4, slice(2, 4))]
    assert by_process[0][:2] + by_process[1][:2] + by_process[0][2:] == first and len(by_process[1]) == 2


def test_null_or_non_string_texts_are_refused_naming_the_shard(tmp_path, corpus):
    """Refused from the footer, before training, where the writer kept statistics; else when the
    row group is read, still naming it (instead of a TypeError in the tokenizer hours in)."""
    _, _, tok = corpus
    texts = ["int a;"] * 30 + [None] + ["int b;"] * 9
    for name, table, stats in (("stats", pa.table({"text": texts}), True),
                               ("nostats", pa.table({"text": texts}), False),
                               ("ints", pa.table({"text": list(range(40))}), True),
                               ("categorical", pa.table({"text": pa.array(["int a;"] * 40).dictionary_encode()}), True)):
        (tmp_path / name).mkdir()
        pq.write_table(table, tmp_path / name / "shard_0.parquet", row_group_size=20,
                       write_statistics=stats)
    with pytest.raises(DataError, match=r"stats/shard_0.parquet: row group 1 has 1 null text"):
        index_units([str(tmp_path / "stats" / "shard_0.parquet")])
    with pytest.raises(DataError, match="the 'text' column holds int64, not strings"):
        index_units([str(tmp_path / "ints" / "shard_0.parquet")])
    assert len(index_units([str(tmp_path / "categorical" / "shard_0.parquet")])) == 2  # strings, encoded
    loader = PackedLoader(str(tmp_path / "nostats"), tok, seq_len=16, rows=2, loop=False)
    with pytest.raises(DataError, match=r"nostats/shard_0.parquet: row group 1 has 1 null text"):
        _take(loader, 1000)


def _tree(root):
    return {str(p): p.read_bytes() for p in sorted(Path(root).rglob("*")) if p.is_file()}


def test_two_vocabulary_sizes_of_the_default_data_live_side_by_side(compose_config):
    small, large = (compose_config([f"data.vocab_size={v}"]).data for v in (512, 600))
    assert small.build_dir != large.build_dir
    prepare(small)
    before = _tree(small.build_dir)
    built = []
    prepare(large, log=built.append)
    assert built and large.build_dir in built[0]
    assert _tree(small.build_dir) == before  # the other vocabulary's corpus and tokenizer untouched
    again = []
    prepare(small, log=again.append)
    assert again == []  # reused, not rebuilt


BUILD = ("import sys\nfrom omegaconf import OmegaConf\nfrom xtrain.data import prepare\n"
         "data = OmegaConf.create(dict(build_sources=['/usr/include/c++'], build_dir=sys.argv[1], "
         "vocab_size=640, chunk_tokens=256, tokenizer=sys.argv[1] + '/tokenizer', tokenizer_threads=2, "
         "train_files=sys.argv[1] + '/train', val_files=sys.argv[1] + '/val'))\n"
         "prepare(data, log=lambda m: print('BUILT', m, flush=True))\n")


def test_concurrent_builds_of_one_corpus_build_it_once_and_never_read_it_half_made(tmp_path):
    out = str(tmp_path / "corpus")
    procs = [subprocess.Popen([sys.executable, "-c", BUILD, out], stdout=subprocess.PIPE, text=True)
             for _ in range(2)]
    outputs = [p.communicate(timeout=600)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0]  # the waiting one loaded a complete tokenizer
    assert sum(o.count("BUILT") for o in outputs) == 1
    assert not list(tmp_path.glob("corpus.building-*")) and (tmp_path / "corpus" / "manifest.json").exists()


def test_a_text_field_nested_in_a_struct_is_not_the_text_column(tmp_path):
    """Parquet's schema lists leaf names: a struct ``meta`` with a field ``text`` answered "has a
    text column", then the read failed with pyarrow's KeyError; and beside a real ``text`` its
    nulls were blamed on the real one."""
    nested = pa.array([{"text": "a"}, {"text": None}], pa.struct([("text", pa.string())]))
    pq.write_table(pa.table({"meta": nested}), tmp_path / "only_nested.parquet")
    pq.write_table(pa.table({"meta": nested, "text": ["int a;", "int b;"]}), tmp_path / "both.parquet")
    with pytest.raises(DataError, match=r"only_nested\.parquet: no 'text' column \(columns: \['meta'\]\)"):
        index_units([str(tmp_path / "only_nested.parquet")])
    assert index_units([str(tmp_path / "both.parquet")])[0][2] == 2  # one row group of 2 rows
