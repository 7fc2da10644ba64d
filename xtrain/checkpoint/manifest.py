"""What a checkpoint held when it was committed: every file's size and CRC32C, in
``manifest.json``, written before the commit marker; and the check that a committed checkpoint
still matches it (a truncated or altered tensor file is found before anything is loaded).

Each host records the files it wrote itself (on a multi-host save, its own DCP shard files);
the first host gathers every host's entries and writes the manifest. CRC32C is the checksum
Cloud Storage keeps for every object: on ``gs://`` the server's value is read from the object's
metadata (no download, at save time or when verifying); on other filesystems the bytes are read
and hashed here (google-crc32c, in C). Both give the same base64 string for the same bytes.
"""

from __future__ import annotations

import base64
import json

from xtrain.checkpoint.layout import DCP_DATA_FILE, check_inside
from xtrain.paths import url_to_fs

MANIFEST = "manifest.json"
_CHUNK = 8 << 20


def _crc32c(fs, path: str) -> str:
    import google_crc32c

    crc = google_crc32c.Checksum()
    with fs.open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc.update(chunk)
    return base64.b64encode(crc.digest()).decode()


def describe(fs, root: str, relative: list[str]) -> dict[str, dict]:
    """relative path -> {"size", "crc32c"} for files under ``root`` (a checkpoint directory)."""
    out = {}
    for rel in relative:
        path = f"{root}/{rel}"
        info = fs.info(path)
        # Cloud Storage states each object's CRC32C; elsewhere the file is read
        out[rel] = {"size": int(info["size"]), "crc32c": info.get("crc32c") or _crc32c(fs, path)}
    return out


def gather(entries: dict | None, process_group) -> dict | None:
    """Every host's entries, merged on the first host (a no-op on one host); None there when
    any host's are None (it could not describe its files). Collective."""
    if process_group is None:
        return entries
    import torch.distributed as dist

    ranks = dist.get_world_size(process_group)
    gathered = [None] * ranks if dist.get_rank(process_group) == 0 else None
    dist.gather_object(entries, gathered, dst=dist.get_global_rank(process_group, 0),
                       group=process_group)
    if gathered is None:
        return {}
    if any(part is None for part in gathered):
        return None
    merged: dict = {}
    for part in gathered:
        merged.update(part)
    return merged


def write(fs, root: str, entries: dict) -> None:
    fs.pipe_file(f"{root}/{MANIFEST}", json.dumps({"files": entries}, indent=1).encode())


def _loaded(fs, root: str) -> list[str]:
    """The files a load reads: state.pt and DCP's (its .metadata and data files) in tensors/."""
    tensors = f"{root}/tensors"
    listed = fs.ls(tensors, detail=False) if fs.exists(tensors) else []
    names = [p.rstrip("/").rsplit("/", 1)[-1] for p in listed]
    return ["state.pt", "tensors/.metadata"] + [f"tensors/{n}" for n in sorted(names) if DCP_DATA_FILE.fullmatch(n)]


def problems(path: str) -> list[str]:
    """How the checkpoint at ``path`` differs from its manifest (empty: intact). One without a
    manifest cannot be verified and counts as damaged (every commit writes one first). A
    manifest naming a file outside the checkpoint is refused (CheckpointError), nothing read."""
    fs, root = url_to_fs(path)
    fs.invalidate_cache()  # gcsfs caches object metadata: a stale size would hide a truncation
    if not fs.exists(f"{root}/{MANIFEST}"):
        return [f"{MANIFEST} missing"]
    try:
        recorded = json.loads(fs.cat_file(f"{root}/{MANIFEST}"))["files"]
        if not all(isinstance(w, dict) and isinstance(w.get("size"), int)
                   and isinstance(w.get("crc32c"), str) for w in recorded.values()):
            raise TypeError("an entry without a size or a crc32c")
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        return [f"{MANIFEST} unreadable ({type(e).__name__}: {e})"]
    check_inside(path, recorded)
    found = [f"{rel} is not in {MANIFEST} (unverifiable)" for rel in _loaded(fs, root) if rel not in recorded]
    for rel, want in sorted(recorded.items()):
        if not fs.exists(f"{root}/{rel}"):
            found.append(f"{rel} missing")
            continue
        info = fs.info(f"{root}/{rel}")
        if info.get("islink") or info.get("type") != "file":  # (a link to /dev/zero: read forever)
            found.append(f"{rel} is not a plain file (a symlink, a directory, a device or a pipe)")
            continue
        if int(info["size"]) != want["size"]:  # (known without reading it)
            found.append(f"{rel} has {int(info['size']):,} bytes, {want['size']:,} when saved")
            continue
        have = describe(fs, root, [rel])[rel]
        if have["crc32c"] != want["crc32c"]:
            found.append(f"{rel} changed since it was saved (crc32c {have['crc32c']}, "
                         f"{want['crc32c']} when saved)")
    return found

