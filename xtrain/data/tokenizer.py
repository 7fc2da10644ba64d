"""Tokenizers: HF ``tokenizers`` byte-level BPE (trained by xtrain), or an existing nanochat
directory (tiktoken ``tokenizer.pkl`` + ``token_bytes.pt``). Both expose the same small interface.

``token_bytes[i]`` is the UTF-8 byte length of token i (0 for special tokens): bits-per-byte
divides the summed loss by the bytes the predicted tokens stand for.
"""

from __future__ import annotations

import io
import pickle

import fsspec
import numpy as np

BOS = "<|bos|>"
SPECIAL_TOKENS = [BOS]


class DataError(ValueError):
    """Bad or missing data; the message names the path."""


class Tokenizer:
    def __init__(self, backend, kind: str, token_bytes: np.ndarray, threads: int = 2):
        self.backend, self.kind, self.threads = backend, kind, threads
        self.token_bytes = np.asarray(token_bytes, dtype=np.int32)
        if kind == "hf":
            self.bos_id = backend.token_to_id(BOS)
            self.vocab_size = backend.get_vocab_size()
        else:
            self.bos_id = backend.encode_single_token(BOS)
            self.vocab_size = backend.n_vocab
        if self.bos_id is None:
            raise DataError(f"tokenizer has no {BOS} token")

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        if self.kind == "hf":  # the _fast variant skips offsets: ~20% faster, all we need are ids
            encode = getattr(self.backend, "encode_batch_fast", self.backend.encode_batch)
            return [e.ids for e in encode(texts, add_special_tokens=False)]
        return self.backend.encode_ordinary_batch(texts, num_threads=self.threads)

    def encode(self, text: str) -> list[int]:
        return self.encode_batch([text])[0]

    def decode(self, ids) -> str:
        ids = [int(i) for i in ids]
        if self.kind == "hf":
            return self.backend.decode(ids, skip_special_tokens=False)
        return self.backend.decode(ids)


def train_bpe(texts, vocab_size: int):
    """Byte-level BPE over ``texts`` with xtrain's special tokens. Returns (hf tokenizer, token_bytes)."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    return tok, _hf_token_bytes(tok)


def _hf_token_bytes(tok) -> np.ndarray:
    # Byte-level BPE writes each byte as one printable character, so a token's byte length is
    # its string length; special tokens stand for no bytes.
    sizes = np.zeros(tok.get_vocab_size(), dtype=np.int32)
    specials = set(SPECIAL_TOKENS)
    for piece, idx in tok.get_vocab().items():
        sizes[idx] = 0 if piece in specials else len(piece)
    return sizes


def save_hf(tok, token_bytes: np.ndarray, directory: str) -> None:
    import torch

    fs, root = fsspec.core.url_to_fs(directory)
    fs.makedirs(root, exist_ok=True)
    with fs.open(f"{root}/tokenizer.json", "w") as f:
        f.write(tok.to_str())
    with fs.open(f"{root}/token_bytes.pt", "wb") as f:
        torch.save(torch.from_numpy(token_bytes), f)


def load_tokenizer(directory: str, threads: int = 2) -> Tokenizer:
    """``tokenizer.json`` (HF) if present, else nanochat's ``tokenizer.pkl`` (tiktoken).

    The pickle is a trust boundary (unpickling runs code): load only directories you own.
    """
    import torch

    fs, root = fsspec.core.url_to_fs(directory)
    if not fs.exists(f"{root}/token_bytes.pt"):
        raise DataError(f"{directory}: no token_bytes.pt (needed for bits-per-byte)")
    with fs.open(f"{root}/token_bytes.pt", "rb") as f:
        token_bytes = torch.load(io.BytesIO(f.read()), weights_only=True).numpy()
    if fs.exists(f"{root}/tokenizer.json"):
        from tokenizers import Tokenizer as HFTokenizer

        with fs.open(f"{root}/tokenizer.json", "r") as f:
            return Tokenizer(HFTokenizer.from_str(f.read()), "hf", token_bytes, threads)
    if fs.exists(f"{root}/tokenizer.pkl"):
        with fs.open(f"{root}/tokenizer.pkl", "rb") as f:
            enc = pickle.load(f)
        return Tokenizer(enc, "tiktoken", token_bytes, threads)
    raise DataError(f"{directory}: neither tokenizer.json nor tokenizer.pkl found")
