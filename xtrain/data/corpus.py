"""Build a C++ corpus: source tree -> tokenizer + parquet shards (``text`` column) + manifest.

Steps: collect C/C++ files (local dir or fsspec URL); train a byte-level BPE on them; split each
file into chunks that fit a token budget (xtrain/data/cpp_source.py); drop exact duplicate
chunks; hold out whole files for validation; write shards and ``manifest.json`` last (its
presence marks a complete build).

A build replaces only what is recognisably xtrain's (a directory that is missing or empty, holds
a build's manifest or marker, or is the build's own staging directory); anything else at the
output directory, and an output directory overlapping the sources, is refused before a source is
read (``check_output``).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import random
import shutil
from dataclasses import dataclass
from pathlib import Path

import fsspec

from xtrain.data.cpp_source import chunk_source, find_sources
from xtrain.errors import DataError
from xtrain.paths import WRITE_PROBE, is_local, protocol, url_to_fs, write_refused

BUILDER_VERSION = 2  # 2: row groups of 1024 rows (larger tokenizer batches)
ROWS_PER_SHARD = 2048
ROWS_PER_ROW_GROUP = 1024  # one loader unit: one tokenizer call (bigger calls parallelise better)
# Written into a build's directory before anything else (and kept): a build written in place (an
# object store) and killed before its manifest (written last) is still recognised as xtrain's.
BUILD_MARKER = ".xtrain-corpus"


# --- building --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Names:
    """How errors name a build's sources and vocabulary size: as a training's data config does
    (CONFIG_NAMES), or as the corpus CLI's arguments (CLI_NAMES, xtrain/data/__main__.py)."""
    sources: str
    vocab_size: str
    separator: str  # between a name and its value

    def setting(self, name: str, value) -> str:
        return f"{getattr(self, name)}{self.separator}{value}"


CONFIG_NAMES = Names(sources="data.build_sources", vocab_size="data.vocab_size", separator="=")
CLI_NAMES = Names(sources="sources", vocab_size="--vocab-size", separator=" ")


@dataclass
class BuildSpec:
    sources: list[str]
    out_dir: str
    vocab_size: int
    chunk_tokens: int
    val_fraction: float = 0.05
    seed: int = 0
    names: Names = CONFIG_NAMES  # (not part of the build's key)

    def key(self, fingerprints) -> str:
        h = hashlib.sha256(json.dumps([BUILDER_VERSION, self.vocab_size, self.chunk_tokens,
                                       self.val_fraction, self.seed, fingerprints]).encode())
        return h.hexdigest()


def read_manifest(out_dir: str) -> dict | None:
    """The build's manifest, or None when there is none (or it is not an xtrain build's)."""
    fs, root = url_to_fs(out_dir)
    path = f"{root}/manifest.json"
    if not fs.exists(path):
        return None
    try:
        with fs.open(path, "r") as f:
            manifest = json.load(f)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(manifest, dict):
        return None
    if "build_key" in manifest:  # its name in builds before 2026-12 (a launch's secret scan read
        manifest["build_hash"] = manifest.pop("build_key")  # "key" as a secret's name)
    return manifest if {"build_hash", "builder_version"} <= manifest.keys() else None


def _where(url: str) -> tuple[str, str]:
    """(protocol, absolute path) of a local path or URL: local paths resolved (``~``, ``..``,
    symlinks), so two spellings of one directory compare equal."""
    fs, path = url_to_fs(url)
    if is_local(url):
        return "file", os.path.realpath(path)
    return protocol(fs), "/" + path.strip("/")


def _overlap(out_dir: str, source: str) -> str | None:
    (out_proto, out), (src_proto, src) = _where(out_dir), _where(source)
    if out_proto != src_proto:
        return None
    if out == src:
        return "is"
    common = os.path.commonpath([out, src])
    return "is inside" if common == src else "contains" if common == out else None


def _in_the_way(out_dir: str) -> str | None:
    """What at ``out_dir`` a build would delete that is not xtrain's, said for a refusal; None when
    the directory is missing, empty, or a build of xtrain's (its manifest.json or BUILD_MARKER)."""
    fs, root = url_to_fs(out_dir)
    root = root.rstrip("/") or "/"
    if not fs.exists(root):
        return None
    if not fs.isdir(root):
        return "is a file"
    names = sorted({p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(root, detail=False)
                    if p.rstrip("/") != root})
    names = [name for name in names if not name.startswith(WRITE_PROBE)]  # (another build's)
    if not names or BUILD_MARKER in names or read_manifest(out_dir) is not None:
        return None
    more = f" and {len(names) - 8} more" if len(names) > 8 else ""
    return "holds " + ", ".join(names[:8]) + more


def _unwritable(out_dir: str) -> str | None:
    """Why a build could not write ``out_dir``: remote, from a probe written there; local (where
    nothing is made before the build), why it could not make the directory and its lock beside
    it, as far as the closest existing parent's kind and permissions tell. None when nothing
    says so."""
    if not is_local(out_dir):
        return write_refused(out_dir)
    place = Path(os.path.expanduser(url_to_fs(out_dir)[1])).absolute().parent
    while not place.exists():
        place = place.parent
    if not place.is_dir():
        return f"{place} is a file"
    return None if os.access(place, os.W_OK) else f"{place} is not writable"


def check_output(sources: list[str], out_dir: str) -> None:
    """Refuse an output directory a build would destroy something in: one that is or contains
    the working directory, that is, lies inside or contains a source directory, or holds
    anything but a previous xtrain build; and one it could not write. Reads no source file."""
    why = _unwritable(out_dir) if read_manifest(out_dir) is None else None  # (a build: reused)
    if why:
        raise DataError(f"corpus output directory {out_dir} cannot be written: {why}")
    here = _overlap(out_dir, os.getcwd())
    if here in ("is", "contains"):  # replaced, it would take the working directory with it
        raise DataError(f"corpus output directory {out_dir} {here} the working directory: a build "
                        "replaces its output directory; choose a new directory (--out, or "
                        "data.build_dir)")
    for source in sources:
        relation = _overlap(out_dir, source)
        if relation:
            raise DataError(
                f"corpus output directory {out_dir} {relation} the source directory {source}: a "
                "build replaces its output directory, so it would delete sources; choose an output "
                "directory outside the sources (--out, or data.build_dir)")
    found = _in_the_way(out_dir)
    if found:
        raise DataError(
            f"corpus output directory {out_dir} is not an xtrain corpus build (no build "
            f"manifest.json or {BUILD_MARKER}) and {found}: a build replaces its output directory, "
            "so it would delete what is there; choose a new or empty directory (--out, or "
            "data.build_dir), or move that away")


def _check_usable(spec, vocab_size: int, chunks: dict[str, int], counts: str) -> None:
    """Refuse, before anything is written, a build that a run would fail on later and less
    clearly: no training or no validation chunk left (``chunks`` per split; ``counts`` says what
    became of the files: a held-out file may be blank or repeat earlier files), or a vocabulary
    smaller than ``data.vocab_size`` (too little text to learn that many tokens from)."""
    named = spec.names.setting
    for split, name in (("train", "training"), ("val", "validation")):
        if not chunks[split]:
            raise DataError(f"{named('sources', spec.sources)}: no {name} chunk left ({counts}): "
                            "name more, or other, sources")
    if vocab_size < spec.vocab_size:
        raise DataError(f"{named('sources', spec.sources)}: these sources give a vocabulary of "
                        f"{vocab_size} tokens, fewer than {named('vocab_size', spec.vocab_size)}: "
                        f"name more sources, or set {named('vocab_size', vocab_size)} or less")


def checked_sources(roots: list[str], names: Names = CONFIG_NAMES) -> list[tuple[str, str]]:
    """:func:`find_sources`, refusing fewer than 2 files: validation holds out whole files."""
    named = names.setting("sources", roots)
    try:
        files = find_sources(roots)
    except DataError as e:  # (a root that does not exist)
        raise DataError(f"{named}: {e}") from None
    if not files:
        raise DataError(f"{named}: no C/C++ sources found (install g++ for /usr/include/c++, or "
                        "name a directory of C++ code)")
    if len(files) < 2:
        raise DataError(f"{named}: only one C/C++ source file ({files[0][0]}); the build holds "
                        "out whole files for validation, so it needs at least 2")
    return files


def replaced_build(spec: BuildSpec) -> dict | None:
    """The manifest of the build in ``spec.out_dir`` that :func:`ensure_built` would replace (one
    of other sources or settings), else None."""
    manifest = read_manifest(spec.out_dir)
    if manifest and manifest.get("build_hash") != spec.key(checked_sources(spec.sources, spec.names)):
        return manifest
    return None


def ensure_built(spec: BuildSpec, log=print) -> dict:
    """Build unless a complete build of the same inputs exists; returns the manifest. Refuses
    (check_output) before reading a source when the output directory is not the build's to
    replace."""
    check_output(spec.sources, spec.out_dir)
    files = checked_sources(spec.sources, spec.names)
    key = spec.key(files)
    manifest = read_manifest(spec.out_dir)
    if manifest and manifest.get("build_hash") == key:
        return manifest
    if not is_local(spec.out_dir):  # object stores: written in place, the manifest last
        log(f"building C++ corpus from {len(files)} files under {spec.sources} -> {spec.out_dir}")
        return build(spec, [url for url, _ in files], key, spec.out_dir)
    # a file:// URL as its path; a symlinked dir as the place it points to (renamed there)
    out = Path(os.path.realpath(os.path.expanduser(spec.out_dir.removeprefix("file://"))))
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        lock = open(f"{out}.lock", "w")
    except OSError as e:  # (a read-only place, a parent that is a file)
        raise DataError(f"corpus output directory {spec.out_dir} cannot be written: {e.strerror}: "
                        f"{e.filename}") from e
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one builder at a time; the others wait, then reuse
        manifest = read_manifest(str(out))
        if manifest and manifest.get("build_hash") == key:
            return manifest
        check_output(spec.sources, str(out))  # again: it may have changed while we waited
        replaced = " (replacing its build of other sources or settings)" if manifest else ""
        log(f"building C++ corpus from {len(files)} files under {spec.sources} -> {out}{replaced}")
        # Built aside, then renamed into place: ``out`` only ever holds a complete build, and a
        # build killed mid-way leaves only its ``<out>.building-<pid>`` directory. That name is
        # how a partial build is recognised: a builder removes the one of its own pid (left by an
        # earlier process with that pid) and leaves others' alone (they may be live elsewhere).
        staging = Path(f"{out}.building-{os.getpid()}")
        shutil.rmtree(staging, ignore_errors=True)
        manifest = build(spec, [url for url, _ in files], key, str(staging))
        if out.exists():
            try:
                check_output(spec.sources, str(out))  # files may have arrived during the build
            except DataError:
                shutil.rmtree(staging, ignore_errors=True)
                raise
            stale = Path(f"{out}.stale-{os.getpid()}")
            shutil.rmtree(stale, ignore_errors=True)
            out.rename(stale)
            staging.rename(out)
            shutil.rmtree(stale)
        else:
            staging.rename(out)
        return manifest


def _claim(sources: list[str], out_dir: str, key: str, writes: set[str]) -> dict | None:
    """Make ``out_dir`` the build's once check_output finds it the build's to replace (a stale
    build in place, or a partial one: a build on an object store is written in place, manifest
    last), or return the manifest of a build of the same inputs completed meanwhile. The marker
    goes in first, so a build killed while clearing is still xtrain's. Only files the build will
    not write go (the manifest among them): another builder of the same inputs writes the same
    bytes under the same names, so two never delete each other's files."""
    check_output(sources, out_dir)
    done = read_manifest(out_dir)
    if done and done.get("build_hash") == key:
        return done
    fs, root = url_to_fs(out_dir)
    fs.makedirs(root, exist_ok=True)
    with fs.open(f"{root}/{BUILD_MARKER}", "w") as f:
        json.dump({"builder": "xtrain.data.corpus", "builder_version": BUILDER_VERSION}, f)
    base = root.rstrip("/") + "/"
    for path in fs.find(root):
        if path.removeprefix(base) not in writes | {BUILD_MARKER}:
            fs.rm(path)
    return None


def _shard_name(split: str, index: int) -> str:
    return f"{split}/shard_{index:05d}.parquet"


def build(spec: BuildSpec, urls: list[str], key: str, out_dir: str) -> dict:
    from xtrain.data.tokenizer import train_bpe

    texts = {}
    source_hash = hashlib.sha256()
    for url in urls:
        with fsspec.open(url, "rb") as f:
            raw = f.read()
        source_hash.update(url.encode() + b"\0" + raw)
        texts[url] = raw.decode("utf-8", errors="replace")

    tok, token_bytes = train_bpe(list(texts.values()), spec.vocab_size)
    encodings = tok.encode_batch(list(texts.values()), add_special_tokens=False)
    token_starts = {url: [start for start, _ in enc.offsets] for url, enc in zip(texts, encodings)}

    # Hold out whole files (no chunk of a validation file is seen in training).
    rng = random.Random(spec.seed)
    order = list(urls)
    rng.shuffle(order)
    n_val = max(1, int(len(order) * spec.val_fraction)) if len(order) > 1 else 0
    val_files = set(order[:n_val])

    seen, splits, duplicates = set(), {"train": [], "val": []}, 0
    for url in urls:
        for chunk in chunk_source(texts[url], token_starts[url], spec.chunk_tokens):
            digest = hashlib.sha256(chunk.encode()).digest()
            if digest in seen:
                duplicates += 1
                continue
            seen.add(digest)
            splits["val" if url in val_files else "train"].append(chunk)
    rng.shuffle(splits["train"])
    _check_usable(spec, tok.get_vocab_size(), {k: len(v) for k, v in splits.items()},
                  f"{len(urls)} files, {n_val} held out for validation, {duplicates} duplicate "
                  "chunks dropped")

    shards = {(split, i // ROWS_PER_SHARD): rows[i:i + ROWS_PER_SHARD]
              for split, rows in splits.items() for i in range(0, max(1, len(rows)), ROWS_PER_SHARD)}
    writes = {_shard_name(*shard) for shard in shards} | {"tokenizer/tokenizer.json",
                                                         "tokenizer/token_bytes.pt"}
    done = _claim(spec.sources, out_dir, key, writes)
    if done:
        return done
    _write(out_dir, tok, token_bytes, shards)
    counts = {split: {"chunks": len(rows), "bytes": sum(len(r.encode()) for r in rows)}
              for split, rows in splits.items()}
    manifest = {
        "build_hash": key, "builder_version": BUILDER_VERSION, "sources": spec.sources,
        "files": len(urls), "val_files": n_val, "source_sha256": source_hash.hexdigest(),
        "vocab_size": tok.get_vocab_size(), "chunk_tokens": spec.chunk_tokens,
        "duplicates_dropped": duplicates, **counts,
    }
    fs, root = url_to_fs(out_dir)
    with fs.open(f"{root}/manifest.json", "w") as f:  # written last: marks the build complete
        json.dump(manifest, f, indent=2)
    return manifest


def _write(out_dir: str, tok, token_bytes, shards: dict) -> None:
    """The tokenizer, then the shards ({(split, index): rows})."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from xtrain.data.tokenizer import save_hf

    fs, root = url_to_fs(out_dir)
    save_hf(tok, token_bytes, f"{out_dir}/tokenizer")
    for split in {split for split, _ in shards}:
        fs.makedirs(f"{root}/{split}", exist_ok=True)
    for shard, rows in shards.items():
        with fs.open(f"{root}/{_shard_name(*shard)}", "wb") as f:
            pq.write_table(pa.table({"text": rows}), f, row_group_size=ROWS_PER_ROW_GROUP)
