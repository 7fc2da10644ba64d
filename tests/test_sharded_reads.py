"""Reading a sharded checkpoint from remote storage: each process copies DCP's metadata and only
the files holding its own shards, not every process's files (xtrain/checkpoint/io.py,
StagingReader). Two real gloo processes save and load a row-sharded tensor through a GCS
emulator, as hosts of a pod save and load their shards of the model."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch


def _save_then_load(rank: int, world: int, init: str, url: str, out_dir: str) -> None:
    import tempfile

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from xtrain import compat
    from xtrain.checkpoint.io import StagingReader
    from xtrain.paths import url_to_fs

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    full = torch.arange(64.0).reshape(8, 8)
    dcp.save({"w": distribute_tensor(full, mesh, [Shard(0)])},
             storage_writer=compat.fsspec_writer(url))
    target = {"w": distribute_tensor(torch.zeros(8, 8), mesh, [Shard(0)])}
    fs, root = url_to_fs(url)
    with tempfile.TemporaryDirectory() as staging:
        reader = StagingReader(fs, root, staging)
        dcp.load(target, storage_reader=reader)
    rows = slice(rank * 8 // world, (rank + 1) * 8 // world)
    loaded = torch.equal(target["w"].to_local(), full[rows])
    stored = sorted(p.rsplit("/", 1)[-1] for p in fs.ls(root, detail=False))
    dist.destroy_process_group()
    Path(out_dir, f"{rank}.json").write_text(json.dumps(
        {"copied": reader.copied, "stored": stored, "loaded": loaded}))


def test_each_process_copies_only_the_files_of_its_own_shards(tmp_path, gcs_bucket):
    import torch.multiprocessing as mp

    bucket, _ = gcs_bucket
    url = f"{bucket}/ckpt/step_000001/tensors"
    mp.spawn(_save_then_load, args=(2, f"file://{tmp_path}/rendezvous", url, str(tmp_path)), nprocs=2)
    results = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(2)]
    assert results[0]["stored"] == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    for rank, result in enumerate(results):
        assert result["loaded"]
        assert result["copied"] == [".metadata", f"__{rank}_0.distcp"], (rank, result)
