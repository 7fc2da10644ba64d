"""Tokenizers: HF ``tokenizers`` byte-level BPE (trained by xtrain), or an existing nanochat
directory (tiktoken ``tokenizer.pkl`` + ``token_bytes.pt``). Both expose the same small interface.

xtrain trains with HF ``tokenizers`` but encodes with tiktoken: a plain byte-level BPE converts
exactly (same ids, checked on the whole corpus by the tests) and tiktoken encodes it about 2.5x
faster on this 2-core machine, which is what lets the loader outrun a TPU host.

``token_bytes[i]`` is the UTF-8 byte length of token i (0 for special tokens): bits-per-byte
divides the summed loss by the bytes the predicted tokens stand for.
"""

from __future__ import annotations

import hashlib
import io
import pickle

import numpy as np

from xtrain.errors import DataError, unpickling_reason
from xtrain.paths import url_to_fs

BOS = "<|bos|>"
SPECIAL_TOKENS = [BOS]
# GPT-2's pre-tokenizer split: the regex HF's ByteLevel(use_regex=True) applies
BYTE_LEVEL_SPLIT = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


class Tokenizer:
    """``fingerprint``: the sha256 of the file the vocabulary was read from (checkpoints record
    it: a model is only resumed with the tokenizer it was trained with)."""

    def __init__(self, backend, kind: str, token_bytes: np.ndarray, threads: int = 2,
                 fingerprint: str | None = None, source: str = "tokenizer"):
        self.backend, self.kind, self.threads = backend, kind, threads
        self.fingerprint = fingerprint
        self.token_bytes = np.asarray(token_bytes, dtype=np.int32)
        if kind == "hf":
            self.bos_id = backend.token_to_id(BOS)
            self.vocab_size = backend.get_vocab_size()
        else:
            try:
                self.bos_id = backend.encode_single_token(BOS)
            except KeyError:  # (tiktoken's answer for a token it lacks)
                self.bos_id = None
            self.vocab_size = backend.n_vocab
        if self.bos_id is None:
            raise DataError(f"{source}: has no {BOS} token, which starts every document xtrain "
                            "packs: not a tokenizer xtrain (or nanochat) trained")

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


def byte_level_alphabet() -> dict[str, int]:
    """Character -> byte of byte-level BPE (GPT-2's table): printable bytes stand for themselves,
    the other bytes, in order, for the code points from 256 up."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    chars = {chr(b): b for b in printable}
    others = [b for b in range(256) if b not in set(printable)]
    chars.update({chr(256 + n): b for n, b in enumerate(others)})
    return chars


def tiktoken_from_hf(spec: dict):
    """The HF tokenizer described by ``spec`` (tokenizer.json, parsed) as a tiktoken Encoding
    with the same ids, or None when it is not a plain byte-level BPE (the only kind that converts
    exactly) or tiktoken is missing.

    Ranks are the HF ids: the trainer numbers merged tokens in merge order, so tiktoken's
    lowest-rank-first merging replays HF's merge priorities."""
    try:
        import tiktoken
    except ImportError:
        return None
    model, pre = spec.get("model") or {}, spec.get("pre_tokenizer") or {}
    plain = (model.get("type") == "BPE" and not model.get("dropout") and spec.get("normalizer") is None
             and pre.get("type") == "ByteLevel" and pre.get("use_regex") and not pre.get("add_prefix_space"))
    if not plain:
        return None
    alphabet = byte_level_alphabet()
    specials = {t["content"]: t["id"] for t in spec.get("added_tokens", [])}
    ranks = {bytes(alphabet[c] for c in piece): i for piece, i in model["vocab"].items()
             if piece not in specials}
    return tiktoken.Encoding("xtrain-bpe", pat_str=BYTE_LEVEL_SPLIT, mergeable_ranks=ranks,
                             special_tokens=specials)


def save_hf(tok, token_bytes: np.ndarray, directory: str) -> None:
    import torch

    fs, root = url_to_fs(directory)
    fs.makedirs(root, exist_ok=True)
    with fs.open(f"{root}/tokenizer.json", "w") as f:
        f.write(tok.to_str())
    with fs.open(f"{root}/token_bytes.pt", "wb") as f:
        torch.save(torch.from_numpy(token_bytes), f)


class _EncodingState:
    """Stands in for ``tiktoken.core.Encoding`` while unpickling: receives the state the pickle
    holds (plain data) instead of letting tiktoken's ``__setstate__`` act on it."""

    def __setstate__(self, state):
        self.state = state


def _latin1_encode(text, encoding="latin1"):
    """Pickle protocols 2 and 3 store bytes as ``_codecs.encode(str, 'latin1')``; nothing else."""
    if encoding != "latin1" or not isinstance(text, str):
        raise pickle.UnpicklingError(f"_codecs.encode({type(text).__name__}, {encoding!r})")
    return text.encode("latin1")


class _TiktokenUnpickler(pickle.Unpickler):
    """Resolves only the names a pickled tiktoken Encoding refers to, to inert stand-ins: an
    unpickler that imports what the file names runs whatever code the file's author chose
    (``os.system`` through ``__reduce__``), and a tokenizer may come from any URL."""

    ALLOWED = {("tiktoken.core", "Encoding"): _EncodingState, ("_codecs", "encode"): _latin1_encode}

    def find_class(self, module, name):
        if (module, name) not in self.ALLOWED:
            raise pickle.UnpicklingError(f"refers to {module}.{name}")
        return self.ALLOWED[(module, name)]


ENCODING_STATE = {"name": str, "pat_str": str, "mergeable_ranks": dict, "special_tokens": dict}


def _is_encoding_state(state) -> bool:
    """What ``Encoding.__getstate__`` returns for an unregistered encoding: names, the regex and
    the two token tables (bytes -> id, str -> id), nothing else."""
    if not (isinstance(state, dict) and state.keys() == ENCODING_STATE.keys()
            and all(isinstance(state[k], t) for k, t in ENCODING_STATE.items())):
        return False
    ranks, specials = state["mergeable_ranks"].items(), state["special_tokens"].items()
    return (all(isinstance(k, bytes) and type(v) is int for k, v in ranks)
            and all(isinstance(k, str) and type(v) is int for k, v in specials))


def load_tiktoken_pickle(file, where: str):
    """A ``tiktoken.Encoding`` from nanochat's ``tokenizer.pkl`` (``pickle.dump(encoding)``),
    built from the pickle's data alone; any other content is refused with a DataError."""
    import tiktoken

    try:
        obj = _TiktokenUnpickler(file).load()
    except Exception as e:  # noqa: BLE001  (a malformed pickle raises many types)
        raise DataError(f"{where}: refused, not a pickled tiktoken Encoding ({e}); only "
                        "tiktoken.core.Encoding is accepted: unpickling others can run code") from e
    # a registered encoding is pickled by name, and tiktoken would download it: refused too
    if not (isinstance(obj, _EncodingState) and _is_encoding_state(getattr(obj, "state", None))):
        raise DataError(f"{where}: refused, its content is not a tiktoken Encoding's "
                        f"{{{', '.join(ENCODING_STATE)}}}")
    return tiktoken.Encoding(**obj.state)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.pkl")  # HF's, nanochat's: the first found is read


def file_fingerprint(directory: str) -> str | None:
    """The :attr:`Tokenizer.fingerprint` :func:`load_tokenizer` would give the tokenizer in
    ``directory``, without loading it; None while it holds neither file (a corpus not built yet)."""
    fs, root = url_to_fs(directory)
    for name in TOKENIZER_FILES:
        if fs.exists(f"{root}/{name}"):
            return hashlib.sha256(fs.cat_file(f"{root}/{name}")).hexdigest()
    return None


def load_tokenizer(directory: str, threads: int = 2) -> Tokenizer:
    """``tokenizer.json`` (HF) if present, else nanochat's ``tokenizer.pkl`` (tiktoken, read by
    :func:`load_tiktoken_pickle`: data only, never code), with its ``token_bytes.pt`` checked
    against the vocabulary. A damaged or foreign file is refused (DataError) naming it."""
    fs, root = url_to_fs(directory)
    if not fs.exists(f"{root}/token_bytes.pt"):
        raise DataError(f"{directory}: no token_bytes.pt (needed for bits-per-byte)")
    token_bytes = _read_token_bytes(fs.cat_file(f"{root}/token_bytes.pt"),
                                    f"{directory}/token_bytes.pt")
    for name, read in zip(TOKENIZER_FILES, (_read_hf, _read_pickle)):
        if fs.exists(f"{root}/{name}"):
            raw = fs.cat_file(f"{root}/{name}")
            backend, kind = read(raw, f"{directory}/{name}")
            tok = Tokenizer(backend, kind, token_bytes, threads, hashlib.sha256(raw).hexdigest(),
                            source=f"{directory}/{name}")
            return _check_token_bytes(tok, directory, name)
    raise DataError(f"{directory}: neither tokenizer.json nor tokenizer.pkl found")


def _read_hf(raw: bytes, where: str):
    """(backend, kind) of a ``tokenizer.json``: tiktoken's when it converts exactly, else HF's."""
    import json

    from tokenizers import Tokenizer as HFTokenizer

    try:
        text = raw.decode()
        fast = tiktoken_from_hf(json.loads(text))
        return (fast, "tiktoken") if fast is not None else (HFTokenizer.from_str(text), "hf")
    except Exception as e:  # noqa: BLE001  (a damaged file fails in many ways: UTF-8, JSON, tokenizers)
        reason = (str(e).splitlines() or [""])[0][:200]
        raise DataError(f"{where}: not a readable tokenizer ({type(e).__name__}: {reason}): the "
                        "file is damaged or not a tokenizers JSON file; copy it again, or rebuild "
                        "the corpus that made it") from e


def _read_pickle(raw: bytes, where: str):
    return load_tiktoken_pickle(io.BytesIO(raw), where), "tiktoken"


def _read_token_bytes(data: bytes, where: str) -> np.ndarray:
    import torch

    try:
        loaded = torch.load(io.BytesIO(data), weights_only=True)  # untrusted: data, never code
    except Exception as e:  # noqa: BLE001  (a damaged pickle raises many types)
        raise DataError(f"{where}: not a saved tensor ({unpickling_reason(e)}): the file is damaged "
                        "or foreign; only plain tensors are loaded from it") from e
    if not isinstance(loaded, torch.Tensor):
        raise DataError(f"{where}: holds a {type(loaded).__name__}, not a tensor of byte lengths "
                        "(one per token)")
    if loaded.is_floating_point() or loaded.is_complex() or loaded.dtype == torch.bool:
        raise DataError(f"{where}: holds {loaded.dtype} values, not whole byte lengths (one per "
                        "token, an integer tensor)")
    return loaded.numpy()


def _check_token_bytes(tok: Tokenizer, directory: str, vocabulary: str) -> Tokenizer:
    """Refuse a ``token_bytes.pt`` that is not one byte length per token of ``vocabulary``'s:
    validation indexes it by every target id (bits per byte), and a short or 2-D one failed
    there, at the end of a training run, after its last checkpoint."""
    shape = tok.token_bytes.shape
    if shape != (tok.vocab_size,):
        found = f"{shape[0]}" if len(shape) == 1 else f"an array of shape {shape}"
        raise DataError(f"{directory}/token_bytes.pt: expected {tok.vocab_size} byte lengths (one "
                        f"per token of {vocabulary}), found {found}: it belongs to another "
                        "tokenizer; put this tokenizer's own token_bytes.pt beside it")
    return tok
