"""Where xtrain keeps things: the cache root, and fsspec URL handling shared by data, checkpoints
and logs (local paths and ``gs://`` alike)."""

from __future__ import annotations

import os
import socket
from pathlib import Path


def cache_root() -> Path:
    """Derived, rebuildable state (corpora, tokenizers, compile reports): ``$XTRAIN_CACHE``, else
    ``~/.cache/xtrain``."""
    return Path(os.environ.get("XTRAIN_CACHE") or Path.home() / ".cache" / "xtrain")


PRIMARY_CONFIG = "train"  # conf/train.yaml: the config `python -m xtrain` composes (--config-name)


def config_dir() -> str:
    """Installed wheels carry the configs as xtrain/conf; a source checkout has them at ../conf."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "conf", here.parent / "conf"):
        if (candidate / f"{PRIMARY_CONFIG}.yaml").exists():
            return str(candidate)
    raise FileNotFoundError(f"xtrain configs not found next to {here}")


def url_to_fs(url: str):
    """(filesystem, path without protocol) for a local path or any fsspec URL; ``~`` expanded."""
    import fsspec

    return fsspec.core.url_to_fs(os.path.expanduser(str(url)))


def protocol(fs) -> str:
    return fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]


def as_url(fs, path: str) -> str:
    """A path that ``fs`` returned (listings drop the protocol) as a URL any fsspec call accepts."""
    return path if is_local_fs(fs) else f"{protocol(fs)}://{path}"


def is_local_fs(fs) -> bool:
    return protocol(fs) in ("file", "local")


def is_local(url: str) -> bool:
    return "://" not in str(url) or str(url).startswith("file://")


def location(url: str) -> str:
    """One spelling of a storage location, to compare two: a local path made absolute (``ckpt``,
    ``./ckpt``, ``~/ckpt`` and ``file:///.../ckpt`` alike), a remote URL without a trailing ``/``."""
    url = str(url).rstrip("/")
    return os.path.abspath(url_to_fs(url)[1]) if is_local(url) else url


def write_whole(url: str, data: bytes) -> None:
    """``data`` as the file at ``url``, its directory made: readers (and a failed write) see the
    old file or the new one, never half of one. An object store replaces objects whole; a local
    file is written aside and renamed over."""
    fs, root = url_to_fs(url)
    fs.makedirs(root.rsplit("/", 1)[0], exist_ok=True)
    if not is_local(url):
        fs.pipe_file(root, data)
        return
    tmp = f"{root}.{os.getpid()}.tmp"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, root)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


WRITE_PROBE = ".write-probe-"  # a file's name prefix: written and removed at once, never data


def write_refused(directory: str) -> str | None:
    """Why a file cannot be written to ``directory`` (made if missing; a missing bucket, no
    permission, a file in the way), from writing and removing a probe there; None when it can."""
    fs, root = url_to_fs(directory)
    probe = f"{root.rstrip('/')}/{WRITE_PROBE}{socket.gethostname()}-{os.getpid()}"
    try:
        fs.makedirs(root, exist_ok=True)
        fs.pipe_file(probe, b"")
        fs.rm(probe)
    except Exception as e:  # noqa: BLE001  (each filesystem raises its own types)
        return f"{type(e).__name__}: {e}"
    return None
