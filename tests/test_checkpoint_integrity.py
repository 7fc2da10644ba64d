"""Committed checkpoints whose files broke afterwards: sizes and CRC32C recorded at save time
(manifest.json, every host its own files), checked before resuming; the run falls back to the
previous committed checkpoint and says which one it passed over."""

from __future__ import annotations

import base64
import json
import shutil
from pathlib import Path

import pytest
import torch

from conftest import assert_same_tensors, checkpoint_tensors, finish, gcs_filesystem, losses, xtrain
from xtrain.checkpoint import manifest
from xtrain.checkpoint.async_io import FsspecCheckpointIO
from xtrain.errors import CheckpointError
from xtrain.inputs import resume_checkpoint


def _save(path: str, tensors: dict) -> None:
    io = FsspecCheckpointIO(retries=0)
    io.save_checkpoint({"state_dict": tensors, "global_step": 3}, path)
    assert io.wait() is not None


def _flip_a_bit(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x10
    path.write_bytes(bytes(data))


def _crc32c(path: Path) -> str:
    """As Cloud Storage states it: base64 of the big-endian CRC32C."""
    import google_crc32c

    return base64.b64encode(google_crc32c.Checksum(path.read_bytes()).digest()).decode()


def _tensor_file(ckpt: Path) -> Path:
    (found,) = (ckpt / "tensors").glob("*.distcp")  # one host: one DCP file
    return found


def test_the_manifest_records_every_file_and_catches_truncation_and_bit_flips(tmp_path):
    ckpt = tmp_path / "step_000003"
    _save(str(ckpt), {"w": torch.arange(1000.0), "b": torch.ones(7)})
    recorded = json.loads((ckpt / manifest.MANIFEST).read_text())["files"]
    data = _tensor_file(ckpt)
    rel = f"tensors/{data.name}"
    assert set(recorded) == {rel, "tensors/.metadata", "state.pt", "meta.json"}
    assert all(recorded[f]["size"] == (ckpt / f).stat().st_size for f in recorded)
    assert manifest.problems(str(ckpt)) == []

    original = data.read_bytes()
    _flip_a_bit(data, len(original) // 2)  # inside w's values: torch.load would not notice
    assert manifest.problems(str(ckpt)) == [
        f"{rel} changed since it was saved (crc32c {_crc32c(data)}, "
        f"{recorded[rel]['crc32c']} when saved)"]
    data.write_bytes(original[:-100])
    assert manifest.problems(str(ckpt)) == [
        f"{rel} has {len(original) - 100:,} bytes, {len(original):,} when saved"]
    data.unlink()
    assert manifest.problems(str(ckpt)) == [f"{rel} missing"]
    with pytest.raises(CheckpointError, match=f"checkpoint.resume={ckpt} is corrupt: {rel} missing"):
        resume_checkpoint(str(ckpt), str(tmp_path), gpt=None, early=True)  # refused before the model is compared


def test_on_gcs_a_commit_marker_written_since_a_cached_listing_is_seen(gcs_bucket):
    """A pod's C++ evaluation waits for its step's checkpoint to be committed by another thread
    or host (xtrain/train/cpp_eval.py): a listing gcsfs cached before the marker was written
    must not hide it."""
    from xtrain.checkpoint.layout import COMMIT_MARKER, is_committed
    from xtrain.paths import url_to_fs

    bucket, _ = gcs_bucket
    step = f"{bucket}/ckpt/step_000004"
    fs, root = url_to_fs(step)  # the instance every xtrain call shares
    fs.pipe_file(f"{root}/meta.json", b"{}")
    fs.ls(root)  # a listing without the marker, cached in that instance
    assert not is_committed(step)
    writer = type(fs)(skip_instance_cache=True)  # another client: the cache above is not told
    writer.pipe_file(f"{root}/{COMMIT_MARKER}", b"")
    assert is_committed(step)


def test_on_gcs_the_servers_crc32c_is_recorded_and_checked(tmp_path, gcs_bucket):
    """No download to record or check a file: Cloud Storage keeps each object's CRC32C, in the
    same form as the one computed here for local files."""
    bucket, _ = gcs_bucket
    url = f"{bucket}/ckpt/step_000003"
    _save(url, {"w": torch.arange(1000.0)})
    fs = gcs_filesystem(bucket)
    recorded = json.loads(fs.cat_file(f"{url}/{manifest.MANIFEST}"))["files"]
    (rel,) = [f for f in recorded if f.endswith(".distcp")]
    fs.get_file(f"{url}/{rel}", str(tmp_path / "copy"))
    assert recorded[rel]["crc32c"] == _crc32c(tmp_path / "copy")
    assert manifest.problems(url) == []
    fs.pipe_file(f"{url}/{rel}", (tmp_path / "copy").read_bytes()[:-8])  # an overwrite, shorter
    assert manifest.problems(url) == [
        f"{rel} has {recorded[rel]['size'] - 8:,} bytes, {recorded[rel]['size']:,} when saved"]


def _host(rank: int, world: int, init: str, path: str) -> None:
    """One host of test_each_host_records_its_own_files: a collective save of its own tensor."""
    import torch.distributed as dist

    from xtrain.checkpoint import io as ckpt_io

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    tensors = ckpt_io.snapshot({f"host{rank}/w": torch.full((256,), float(rank))}, sharded=False)
    ckpt_io.write(path, tensors, b"state", {"step": 1}, rank=rank, process_group=dist.group.WORLD)
    dist.destroy_process_group()


def test_each_host_records_its_own_files(tmp_path):
    """A multi-host save (two gloo processes): each host describes the DCP file it wrote, the
    first gathers them into the one manifest."""
    import torch.multiprocessing as mp

    ckpt = tmp_path / "step_000001"
    mp.spawn(_host, args=(2, f"file://{tmp_path}/rendezvous", str(ckpt)), nprocs=2)
    recorded = json.loads((ckpt / manifest.MANIFEST).read_text())["files"]
    written = sorted(p.name for p in (ckpt / "tensors").glob("*.distcp"))
    assert len(written) == 2 and sorted(f for f in recorded if f.endswith(".distcp")) == [
        f"tensors/{name}" for name in written]
    assert manifest.problems(str(ckpt)) == []
    _flip_a_bit(ckpt / "tensors" / written[1], 100)  # the second host's file
    (problem,) = manifest.problems(str(ckpt))
    assert problem.startswith(f"tensors/{written[1]} changed since it was saved")


@pytest.mark.parametrize("damage", ["truncated", "bit_flipped"])
def test_a_corrupt_newest_checkpoint_is_passed_over_and_the_same_command_resumes(tmp_path, damage):
    run_dir, command = tmp_path / "run", ["trainer.max_steps=20", "checkpoint.every=10"]
    code, _, err = finish(xtrain(run_dir, *command))
    assert code == 0, err[-3000:]
    ckpts = run_dir / "checkpoints"
    first = losses(run_dir)
    shutil.copytree(ckpts / "step_000020", tmp_path / "intact_20")
    data = _tensor_file(ckpts / "step_000020")
    if damage == "truncated":
        data.write_bytes(data.read_bytes()[:-4096])
    else:
        _flip_a_bit(data, data.stat().st_size // 2)
    code, out, err = finish(xtrain(run_dir, *command))  # the same command again
    assert code == 0, err[-3000:]
    assert f"xtrain: warning: checkpoint {ckpts}/step_000020 is corrupt (tensors/{data.name} " in err
    assert "not resuming from it, trying the previous committed one" in err
    assert f"resuming from {ckpts}/step_000010" in out
    assert losses(run_dir) == first  # steps 11-20 again, the same losses
    assert_same_tensors(checkpoint_tensors(ckpts / "step_000020"), checkpoint_tensors(tmp_path / "intact_20"))
