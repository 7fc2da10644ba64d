"""Data: corpus building (corpus.py, from cpp_source.py's chunks of C/C++ files), tokenizers
(tokenizer.py), the streaming loader (loader.py)."""

from __future__ import annotations

from xtrain.data.tokenizer import Tokenizer, load_tokenizer
from xtrain.errors import DataError


def prepare(data, log=print) -> Tokenizer:
    """Build the corpus if the config asks for it (cached), then load and check the tokenizer."""
    if data.build_sources:
        from xtrain.data.corpus import BuildSpec, ensure_built

        spec = BuildSpec(sources=list(data.build_sources), out_dir=data.build_dir,
                         vocab_size=data.vocab_size, chunk_tokens=data.chunk_tokens)
        ensure_built(spec, log=log)
    return checked_tokenizer(data, data.tokenizer)


def checked_tokenizer(data, directory: str) -> Tokenizer:
    """The tokenizer in ``directory`` (``data.tokenizer``, or where a checkpoint's is found:
    xtrain/inputs.py checkpoint_tokenizer), of ``data.vocab_size`` tokens."""
    tokenizer = load_tokenizer(directory, threads=data.tokenizer_threads)
    if tokenizer.vocab_size != data.vocab_size:
        raise DataError(f"tokenizer {directory} has {tokenizer.vocab_size} tokens but "
                        f"data.vocab_size={data.vocab_size}")
    return tokenizer


__all__ = ["Tokenizer", "checked_tokenizer", "load_tokenizer", "prepare"]
