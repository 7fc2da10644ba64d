"""Data: corpus building (corpus.py, from cpp_source.py's chunks of C/C++ files), tokenizers
(tokenizer.py), the streaming loader (loader.py); here, a data config's corpus built on first use
and its checks."""

from __future__ import annotations

from xtrain.data.tokenizer import Tokenizer, load_tokenizer
from xtrain.errors import ConfigError, DataError


def check_built_where_read(data) -> None:
    """A corpus built on first use (``data.build_sources``) is read from where it is built: the
    config alone says so, checked before the run dir is taken."""
    if data.build_sources and not data.build_dir:
        raise ConfigError(f"data.build_sources={list(data.build_sources)}: the corpus is built into "
                          "data.build_dir, which is null; set it (a local dir or gs://...)")
    elsewhere = [f"data.{k}={data[k]}" for k in ("train_files", "val_files", "tokenizer")
                 if data.build_sources and data[k] and data.build_dir
                 and not str(data[k]).startswith(str(data.build_dir).rstrip("/") + "/")]
    if elsewhere:
        raise ConfigError(
            f"data.build_sources is set, so the corpus is built into data.build_dir="
            f"{data.build_dir}, but {', '.join(elsewhere)} reads elsewhere: to read shards of "
            "your own, also set data.build_sources=[]")


def build_spec(data):
    """The corpus build a data config asks for (``data.build_sources`` set)."""
    from xtrain.data.corpus import BuildSpec

    return BuildSpec(sources=list(data.build_sources), out_dir=data.build_dir,
                     vocab_size=data.vocab_size, chunk_tokens=data.chunk_tokens)


def prepare(data, log=print) -> Tokenizer:
    """Build the corpus if the config asks for it (cached), then load and check the tokenizer."""
    if data.build_sources:
        from xtrain.data.corpus import ensure_built

        ensure_built(build_spec(data), log=log)
        check_separate_splits(data)  # (a corpus's shards are known once built)
    return checked_tokenizer(data, data.tokenizer)


def check_separate_splits(data) -> None:
    """Refuse validation shards that are also training shards: validation would score text the
    run trains on (a glob or directory matching both; holdout_last_shard splits one list)."""
    from xtrain.data.loader import list_shards

    if not data.val_files:
        return
    shared = sorted(set(list_shards(data.train_files)) & set(list_shards(data.val_files)))
    if shared:
        raise DataError(f"data.val_files={data.val_files}: {len(shared)} shard(s) also in "
                        f"data.train_files={data.train_files} (first {shared[0]}): validation "
                        "would score text the run trains on; point them at separate shards")


def check_build_keeps(data, checkpoint: str, trained_with: str | None) -> None:
    """Refuse to resume ``checkpoint`` (trained with the tokenizer of sha256 ``trained_with``)
    when its corpus, built on first use, would be built anew: data.build_sources' files or the
    build's settings changed since. The build would replace the shards it trained on, and its data position would not
    continue in the new ones (xtrain/data/loader.py check_position): refused after the build,
    with those shards already gone."""
    from xtrain.data.corpus import replaced_build
    from xtrain.data.tokenizer import file_fingerprint

    spec = build_spec(data)
    stale = replaced_build(spec)
    if not (stale and trained_with and file_fingerprint(data.tokenizer) == trained_with):
        return
    now = {"build_sources": spec.sources, "vocab_size": spec.vocab_size, "chunk_tokens": spec.chunk_tokens}
    built = {"build_sources": stale.get("sources"), "vocab_size": stale.get("vocab_size"),
             "chunk_tokens": stale.get("chunk_tokens")}
    changed = [f"data.{k}={now[k]} (built with {built[k]})" for k in now if now[k] != built[k]]
    raise DataError(
        f"{checkpoint} was trained on the corpus in data.build_dir={data.build_dir}, which this run "
        f"would build anew, replacing the shards the checkpoint trained on: "
        f"{'; '.join(changed) or f'the files under data.build_sources={spec.sources} changed since'} "
        f"(its build read {stale.get('files', '?')} files); to resume, put them back as they were; "
        "to train on the new corpus, start a new run (another run.name)")


def checked_tokenizer(data, directory: str) -> Tokenizer:
    """The tokenizer in ``directory`` (``data.tokenizer``, or where a checkpoint's is found:
    xtrain/inputs.py checkpoint_tokenizer), of ``data.vocab_size`` tokens."""
    tokenizer = load_tokenizer(directory, threads=data.tokenizer_threads)
    if tokenizer.vocab_size != data.vocab_size:
        raise DataError(f"tokenizer {directory} has {tokenizer.vocab_size} tokens but "
                        f"data.vocab_size={data.vocab_size}")
    return tokenizer


__all__ = ["Tokenizer", "build_spec", "check_build_keeps", "check_built_where_read", "checked_tokenizer",
           "load_tokenizer", "prepare"]
