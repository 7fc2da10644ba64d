"""Read back what the loggers wrote, for the tests: a W&B offline run's history and a TensorBoard
event directory.

W&B 0.31 ships no reader for its ``.wandb`` files (they are written by its Go core), so the
record stream is read here: LevelDB's log format (32 KiB blocks of chunks with a 7-byte header:
CRC, length, type) after W&B's 7-byte ``:W&B`` file header, each record a protobuf ``Record``
from ``wandb.proto.wandb_internal_pb2``.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

BLOCK, HEADER = 32 * 1024, 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def _chunks(data: bytes):
    assert data[:4] == b":W&B", "not a W&B run file"
    pos, pending = HEADER, b""
    while pos + HEADER <= len(data):
        if BLOCK - pos % BLOCK < HEADER:  # block trailer: padding
            pos += BLOCK - pos % BLOCK
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + HEADER])
        chunk = data[pos + HEADER:pos + HEADER + length]
        pos += HEADER + length
        if kind == FULL:
            yield chunk
        elif kind == FIRST:
            pending = chunk
        elif kind == MIDDLE:
            pending += chunk
        elif kind == LAST:
            yield pending + chunk
        elif kind == 0 and length == 0:
            break


def wandb_records(path: Path):
    from wandb.proto import wandb_internal_pb2 as pb

    for raw in _chunks(Path(path).read_bytes()):
        record = pb.Record()
        record.ParseFromString(raw)
        yield record


def wandb_run(run_file: Path) -> dict:
    """{"id", "name", "group", "tags", "config": {...}, "history": [{key: value}, ...]}."""
    out = {"history": [], "config": {}}
    for r in wandb_records(run_file):
        kind = r.WhichOneof("record_type")
        if kind == "run":
            out.update(id=r.run.run_id, name=r.run.display_name, group=r.run.run_group,
                       tags=list(r.run.tags))
            out["config"].update({i.key: json.loads(i.value_json) for i in r.run.config.update})
        elif kind == "history":
            out["history"].append({i.key or "/".join(i.nested_key): json.loads(i.value_json)
                                   for i in r.history.item})
        elif kind == "config":
            out["config"].update({i.key: json.loads(i.value_json) for i in r.config.update})
    return out


def wandb_runs(run_dir: Path) -> list[dict]:
    """Every W&B run file under ``<run_dir>/wandb`` (one per process), oldest first."""
    files = sorted(Path(run_dir, "wandb").glob("offline-run-*/run-*.wandb"))
    return [wandb_run(f) for f in files]


def tensorboard_scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def tensorboard_texts(log_dir: Path) -> list[str]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"tensors": 0})
    acc.Reload()
    return [t for t in acc.Tags()["tensors"] if t.endswith("text_summary")]
