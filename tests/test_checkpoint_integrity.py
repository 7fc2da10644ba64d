"""Committed checkpoints whose files broke afterwards: sizes and CRC32C recorded at save time
(manifest.json, every host its own files), checked before resuming; the run falls back to the
previous committed checkpoint and says which one it passed over."""

from __future__ import annotations

import base64
import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from conftest import assert_same_tensors, checkpoint_tensors, finish, gcs_filesystem, losses, xtrain
from xtrain.checkpoint import manifest
from xtrain.checkpoint.layout import COMMIT_MARKER, committed_checkpoints
from xtrain.checkpoint.async_io import FsspecCheckpointIO
from xtrain.errors import CheckpointError
from xtrain.inputs import newest_intact, resume_checkpoint
from xtrain.model.config import GPTConfig


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
    # a file the load reads left out of the manifest (edited by hand) is not taken on trust
    data.write_bytes(original[:-100])
    (ckpt / manifest.MANIFEST).write_text(json.dumps({"files": {k: v for k, v in recorded.items() if k != rel}}))
    assert manifest.problems(str(ckpt)) == [f"{rel} is not in {manifest.MANIFEST} (unverifiable)"]
    # an entry whose checksum's key is damaged (its size still right): unreadable, not a crash
    damaged = {**recorded, rel: {"size": len(original) - 100, "crc32C": recorded[rel]["crc32c"]}}
    (ckpt / manifest.MANIFEST).write_text(json.dumps({"files": damaged}))
    assert manifest.problems(str(ckpt)) == [
        f"{manifest.MANIFEST} unreadable (TypeError: an entry without a size or a crc32c)"]
    (ckpt / manifest.MANIFEST).write_text(json.dumps({"files": recorded}))
    data.unlink()
    with pytest.raises(CheckpointError, match=f"checkpoint.resume={ckpt} is corrupt: {rel} missing"):
        resume_checkpoint(str(ckpt), str(tmp_path), gpt=None, early=True)  # refused before the model is compared


def test_on_local_disk_every_file_is_durable_before_the_commit_and_the_commit_before_retention(
        tmp_path, monkeypatch):
    """A power loss or kernel panic just after a commit must not leave COMMITTED over files still
    in the page cache (retention has by then deleted the previous checkpoint). The loss cannot
    be made here: os.fsync is watched instead, noting each synced path and whether the marker
    existed yet."""
    import os

    synced, fsync = [], os.fsync
    ckpt = tmp_path / "checkpoints" / "step_000003"

    def watched(fd):
        path = Path(os.readlink(f"/proc/self/fd/{fd}"))
        synced.append((path.relative_to(tmp_path).as_posix(), (ckpt / COMMIT_MARKER).exists()))
        return fsync(fd)

    monkeypatch.setattr(os, "fsync", watched)
    _save(str(ckpt), {"w": torch.randn(4, 4)})
    before = {path for path, committed in synced if not committed}
    after = {path for path, committed in synced if committed}
    step = "checkpoints/step_000003"
    assert {f"{step}/{name}" for name in ("state.pt", "meta.json", manifest.MANIFEST, "tensors",
                                          "tensors/.metadata", _tensor_file(ckpt).relative_to(ckpt))} \
        | {step} <= before, sorted(before)
    assert {f"{step}/{COMMIT_MARKER}", step, "checkpoints"} <= after, sorted(after)


def test_a_checkpoint_without_its_manifest_is_not_intact(tmp_path):
    """Every commit writes the manifest first; without it nothing can be verified (and whoever
    deleted it may have changed the rest)."""
    _save(str(tmp_path / "step_000001"), {"w": torch.ones(3)})
    _save(str(tmp_path / "step_000002"), {"w": torch.ones(3)})
    (tmp_path / "step_000002" / manifest.MANIFEST).unlink()
    assert manifest.problems(str(tmp_path / "step_000002")) == [f"{manifest.MANIFEST} missing"]
    assert newest_intact(str(tmp_path)) == f"{tmp_path}/step_000001"


def test_a_run_whose_every_checkpoint_is_damaged_is_refused_not_started_over(tmp_path):
    """Starting from step 0 would overwrite them one by one as the run reaches their steps."""
    for step in (1, 2):
        _save(str(tmp_path / f"step_{step:06d}"), {"w": torch.ones(3)})
        (tmp_path / f"step_{step:06d}" / manifest.MANIFEST).unlink()
    with pytest.raises(CheckpointError, match=f"every committed checkpoint in {tmp_path} is damaged"):
        resume_checkpoint(None, str(tmp_path), gpt=None)


def test_a_run_whose_every_own_checkpoint_is_damaged_is_told_how_to_start_again(tmp_path):
    """The same command run again (checkpoint.resume set) continues its own checkpoints; when all
    are damaged the way out is moving them away, not setting checkpoint.resume, which is set."""
    start = str(tmp_path / "elsewhere" / "step_000002")
    own = tmp_path / "own"
    for step in (4, 6):
        _save(str(own / f"step_{step:06d}"), {"w": torch.ones(3)})
        (own / f"step_{step:06d}" / "meta.json").write_text(
            json.dumps({"step": step, "config": {"checkpoint": {"resume": start}}}))
        (own / f"step_{step:06d}" / manifest.MANIFEST).unlink()
    with pytest.raises(CheckpointError) as refused:
        resume_checkpoint(start, str(own), gpt=None)
    assert str(refused.value).endswith(
        f"move them away to start again from checkpoint.resume={start}, which started them")


class _Payload:
    """Unpickling this runs ``os.system``: what a crafted checkpoint would carry."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        import os

        return os.system, (f"touch {self.marker}",)


def test_a_crafted_dcp_metadata_pickle_runs_no_code_and_is_refused(tmp_path):
    """DCP unpickles tensors/.metadata with plain pickle.load (torch 2.9): xtrain reads it
    allowing only the classes DCP's metadata of tensors is made of, on every path that reads
    a checkpoint (resume and the model's weights for sampling and the C++ evaluation, and the
    check made before a model is built), and refuses it as a CheckpointError (one line, exit 2)."""
    import pickle

    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    from xtrain.checkpoint.io import check_loadable, read, read_model_weights

    ckpt, marker = tmp_path / "step_000001", tmp_path / "code-ran"
    _save(str(ckpt), {"w": torch.ones(3)})
    metadata_file = ckpt / "tensors" / ".metadata"
    genuine = metadata_file.read_bytes()
    assert read(str(ckpt))["state_dict"]["w"].tolist() == [1.0, 1.0, 1.0]  # allowed: a real one

    metadata_file.write_bytes(pickle.dumps(_Payload(marker)))
    for load in (read, read_model_weights, check_loadable):
        with pytest.raises(CheckpointError, match=rf"checkpoint {ckpt}: tensors/ refused \(checkpoint "
                           r"metadata refers to posix\.system.*refused"):
            load(str(ckpt))
    assert not marker.exists()

    # a non-tensor item would make DCP torch.load its bytes with weights_only=False
    metadata = pickle.loads(genuine)  # the file written above: trusted here
    metadata.state_dict_metadata["/state_dict/w"] = BytesStorageMetadata()
    metadata_file.write_bytes(pickle.dumps(metadata))
    with pytest.raises(CheckpointError, match="BytesStorageMetadata"):
        read(str(ckpt))


@pytest.mark.parametrize("damaged", [b"\x80\x04K", b"\x80\x02X\x02\x00\x00\x00\xff\xfe."],
                         ids=["index_error", "unicode_error"])
def test_a_damaged_state_pt_is_refused_in_one_line(tmp_path, damaged):
    """Damaged pickles raise many types in torch.load (these two an IndexError and a
    UnicodeDecodeError): each is a refusal naming the file, not a traceback."""
    from xtrain.checkpoint.io import check_loadable, read

    ckpt = tmp_path / "step_000001"
    _save(str(ckpt), {"w": torch.ones(3)})
    (ckpt / "state.pt").write_bytes(damaged)
    for load in (check_loadable, read):
        with pytest.raises(CheckpointError, match=rf"^checkpoint {ckpt}: state.pt refused \("):
            load(str(ckpt))


def test_a_checkpoint_whose_tensors_lack_one_its_state_refers_to_is_refused(tmp_path, capsys):
    """A committed checkpoint whose files match its manifest but whose tensors/ lacks a tensor its
    state.pt names (torch_xla 2.9's planner left such tensors out: fsdp_tp on one 8-chip host,
    tests/test_xla.py) is refused by name, by the early check and by the read, instead of
    failing on a KeyError after reading the rest; a resume passes it over for the one before."""
    import pickle

    from xtrain.checkpoint.io import check_loadable, read
    from xtrain.paths import url_to_fs

    older, ckpt = tmp_path / "step_000001", tmp_path / "step_000002"
    _save(str(older), {"w": torch.ones(3), "b": torch.zeros(2)})
    _save(str(ckpt), {"w": torch.ones(3), "b": torch.zeros(2)})
    metadata_file = ckpt / "tensors" / ".metadata"
    metadata = pickle.loads(metadata_file.read_bytes())  # the file written above: trusted here
    del metadata.state_dict_metadata["/state_dict/b"]
    metadata_file.write_bytes(pickle.dumps(metadata))
    fs, root = url_to_fs(str(ckpt))  # the manifest agrees: as saved so, not damaged since
    recorded = json.loads((ckpt / manifest.MANIFEST).read_text())["files"]
    manifest.write(fs, root, {**recorded, **manifest.describe(fs, root, ["tensors/.metadata"])})
    assert manifest.problems(str(ckpt)) == []
    for load in (check_loadable, read):
        with pytest.raises(CheckpointError, match=rf"^checkpoint {ckpt}: tensors/ lacks 1 of the "
                           r"tensors its state.pt refers to \(/state_dict/b\): it was saved "
                           "incomplete"):
            load(str(ckpt))
    capsys.readouterr()
    assert newest_intact(str(tmp_path)) == str(older)
    assert f"checkpoint {ckpt} is corrupt (tensors/ lacks 1 of the tensors" in capsys.readouterr().err


def test_retention_counts_only_the_commits_up_to_the_new_one(tmp_path):
    """A run that resumed from step 10 past a damaged step 20 commits step 15: with keep_last=1
    the old rule (the newest commits overall) kept only the damaged 20 and deleted 15, the
    checkpoint just written, leaving nothing to resume from."""
    from xtrain.checkpoint.async_io import FsspecCheckpointIO
    from xtrain.train.checkpointing import PeriodicCheckpoint

    for step in (5, 10, 15, 20):
        _save(str(tmp_path / f"step_{step:06d}"), {"w": torch.full((3,), float(step))})
    keeper = PeriodicCheckpoint(str(tmp_path), every=5, checkpoint_io=FsspecCheckpointIO(), keep_last=2)
    keeper._committed({"step": 15, "path": str(tmp_path / "step_000015")})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000010", "step_000015", "step_000020"]


@pytest.mark.parametrize("replacement", ["symlink", "fifo"])
def test_a_checkpoint_file_that_is_not_a_plain_file_is_found_without_reading_it(tmp_path, replacement):
    """state.pt replaced by a link to /dev/zero, or by a named pipe: verifying hashed it before
    comparing sizes, and never ended (a resume, mode=sample or eval hung). Now it is named at once."""
    import os
    import threading

    ckpt = tmp_path / "step_000003"
    _save(str(ckpt), {"w": torch.ones(3)})
    (ckpt / "state.pt").unlink()
    if replacement == "symlink":
        (ckpt / "state.pt").symlink_to("/dev/zero")
    else:
        os.mkfifo(ckpt / "state.pt")
    found = []
    check = threading.Thread(target=lambda: found.extend(manifest.problems(str(ckpt))), daemon=True)
    check.start()
    check.join(timeout=30)
    assert not check.is_alive(), "verification is still reading"
    assert found == ["state.pt is not a plain file (a symlink, a directory, a device or a pipe)"]


def _marker_unreadable(monkeypatch, step_name: str) -> None:
    """Reading ``step_name``'s commit marker fails with EIO (a flaky disk, a stale NFS handle)."""
    import errno

    from fsspec.implementations.local import LocalFileSystem

    info = LocalFileSystem.info

    def flaky(self, path, **kwargs):
        if str(path).endswith(f"{step_name}/{COMMIT_MARKER}"):
            raise OSError(errno.EIO, "Input/output error")
        return info(self, path, **kwargs)

    monkeypatch.setattr(LocalFileSystem, "info", flaky)


def test_a_commit_whose_marker_could_not_be_read_is_not_deleted_as_a_torn_save(tmp_path, monkeypatch):
    """Reading step 1's COMMITTED fails with EIO (a flaky disk, a stale NFS handle): fsspec's
    exists() says False on any error, so retention took the commit for a torn save older than
    the new one and deleted it, though keep_last and keep_every keep it. Only a marker the
    storage says is missing makes a torn save; a torn one is still removed."""
    from xtrain.checkpoint.async_io import FsspecCheckpointIO
    from xtrain.train.checkpointing import PeriodicCheckpoint

    for step in (1, 2, 3):
        _save(str(tmp_path / f"step_{step:06d}"), {"w": torch.full((3,), float(step))})
    (tmp_path / "step_000002" / "COMMITTED").unlink()  # a torn save
    _marker_unreadable(monkeypatch, "step_000001")
    keeper = PeriodicCheckpoint(str(tmp_path), every=1, checkpoint_io=FsspecCheckpointIO(),
                                keep_last=5, keep_every=1)
    keeper._committed({"step": 3, "path": str(tmp_path / "step_000003")})
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000001", "step_000003"]
    assert [s for s, _ in committed_checkpoints(str(tmp_path))] == [1, 3]


def test_a_save_at_a_step_whose_marker_could_not_be_read_fails_and_keeps_it(tmp_path, monkeypatch):
    """A save at step 3, whose commit's marker cannot be read: the step dir looked like a torn
    attempt, and the save removed it before writing. Now the save fails (a retry asks again)
    and the commit stays."""
    ckpt = tmp_path / "step_000003"
    _save(str(ckpt), {"w": torch.ones(3)})
    _marker_unreadable(monkeypatch, "step_000003")
    io = FsspecCheckpointIO(retries=0)
    io.save_checkpoint({"state_dict": {"w": torch.zeros(3)}, "global_step": 3}, str(ckpt))
    assert io.wait() is None  # given up, with a warning
    monkeypatch.undo()
    assert [p.name for p in tmp_path.iterdir()] == ["step_000003"]
    from xtrain.checkpoint.io import read

    assert read(str(ckpt))["state_dict"]["w"].tolist() == [1.0, 1.0, 1.0]


def test_a_deletion_retention_could_not_make_warns_and_is_made_after_the_next_commit(
        tmp_path, monkeypatch, capsys):
    """Storage fails the first deletion retention asks for (as a flaky bucket can): the commit
    stands and the run goes on with a warning (the error once reached the next save, and a
    preemption's save, and ended the run); the next commit deletes what is still stale."""
    from fsspec.implementations.local import LocalFileSystem

    from xtrain.checkpoint.async_io import FsspecCheckpointIO
    from xtrain.train.checkpointing import PeriodicCheckpoint

    for step in (5, 10):
        _save(str(tmp_path / f"step_{step:06d}"), {"w": torch.full((3,), float(step))})
    real_rm, failures = LocalFileSystem.rm, [OSError("503 Service Unavailable")]

    def flaky(self, path, recursive=False, **kwargs):
        if failures:
            raise failures.pop()
        return real_rm(self, path, recursive=recursive, **kwargs)

    monkeypatch.setattr(LocalFileSystem, "rm", flaky)
    keeper = PeriodicCheckpoint(str(tmp_path), every=5, checkpoint_io=FsspecCheckpointIO(), keep_last=1)
    keeper._committed({"step": 10, "path": str(tmp_path / "step_000010")})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000005", "step_000010"]
    assert (f"could not remove the old checkpoint {tmp_path / 'step_000005'} (OSError: 503 "
            "Service Unavailable); tried again after the next commit") in capsys.readouterr().err
    _save(str(tmp_path / "step_000015"), {"w": torch.full((3,), 15.0)})
    keeper._committed({"step": 15, "path": str(tmp_path / "step_000015")})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000015"]


def test_a_listing_that_fails_after_a_commit_warns_and_the_next_save_goes_on(tmp_path, capsys):
    """Retention lists the checkpoint dir after each commit; a listing storage fails (a bucket's
    error after gcsfs's retries) once reached the next save through the upload's result and
    ended the training, before its final save. The commit stands, with a warning."""
    from xtrain.checkpoint.async_io import FsspecCheckpointIO

    io, calls = FsspecCheckpointIO(), []

    def failing_listing(result):
        calls.append(result["step"])
        if len(calls) == 1:
            raise OSError("500 listing failed")

    io.on_commit = failing_listing
    for step in (5, 10):
        io.save_checkpoint({"state_dict": {"w": torch.full((3,), float(step))}, "global_step": step},
                           tmp_path / f"step_{step:06d}")
        assert io.wait()["step"] == step
    assert calls == [5, 10]
    assert (f"checkpoint {tmp_path / 'step_000005'} committed, but the work after its commit failed "
            "(OSError: 500 listing failed); retention tries again after the next commit") in capsys.readouterr().err
    assert (tmp_path / "step_000010" / "COMMITTED").exists()


def test_a_deletion_cut_short_leaves_no_committed_checkpoint(tmp_path, monkeypatch):
    """Retention and a re-save of a step delete whole directories; the commit marker goes
    first, so a kill in the middle (here: the recursive delete failing) cannot leave a
    committed checkpoint with its files gone."""
    from fsspec.implementations.local import LocalFileSystem

    from xtrain.checkpoint.layout import is_committed, remove

    _save(str(tmp_path / "step_000001"), {"w": torch.ones(3)})
    _save(str(tmp_path / "step_000002"), {"w": torch.ones(3)})
    real_rm = LocalFileSystem.rm

    def killed_midway(self, path, recursive=False, **kwargs):
        if recursive:
            shutil.rmtree(Path(path) / "tensors")
            raise KeyboardInterrupt("killed while deleting")
        return real_rm(self, path, recursive=recursive, **kwargs)

    monkeypatch.setattr(LocalFileSystem, "rm", killed_midway)
    with pytest.raises(KeyboardInterrupt):
        remove(str(tmp_path / "step_000002"))
    monkeypatch.undo()
    assert not is_committed(str(tmp_path / "step_000002"))
    assert newest_intact(str(tmp_path)) == f"{tmp_path}/step_000001"


def test_the_early_check_leaves_an_unreadable_newest_meta_json_to_the_runs_fallback(
        tmp_path, compose_config, capfd):
    """The early (pre-build) check reads the newest commit's model from its meta.json without
    verifying checksums; a damaged meta.json there must not refuse a run that the verified
    choice resumes from the previous checkpoint."""
    cfg = compose_config(["model=d2"])
    cfg.model.vocab_size, cfg.model.sequence_len = 512, 64  # as the planner resolves them
    gpt = GPTConfig.from_model(cfg.model)
    for step in (10, 20):
        io = FsspecCheckpointIO(retries=0)
        io.save_checkpoint({"state_dict": {"w": torch.ones(3)}, "global_step": step,
                            "xtrain_meta": {"config": {"model": OmegaConf.to_container(
                                cfg.model, enum_to_str=True)}}},  # as run_meta writes it
                           str(tmp_path / f"step_{step:06d}"))
        assert io.wait() is not None
    meta = tmp_path / "step_000020" / "meta.json"
    meta.write_text(meta.read_text()[:20])
    assert resume_checkpoint(None, str(tmp_path), gpt, early=True) is None
    assert resume_checkpoint(None, str(tmp_path), gpt) == f"{tmp_path}/step_000010"
    assert f"checkpoint {tmp_path}/step_000020 is corrupt (meta.json has " in capfd.readouterr().err


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


def test_a_save_to_gcs_flushes_no_local_disk(gcs_bucket, monkeypatch):
    """DCP fsyncs each file it writes; a Cloud Storage file has no descriptor, and DCP then
    called os.sync(), which writes every dirty page of the machine to disk, twice a save."""
    import os

    bucket, _ = gcs_bucket
    synced = []
    monkeypatch.setattr(os, "sync", lambda: synced.append("os.sync"))
    _save(f"{bucket}/ckpt/step_000003", {"w": torch.arange(1000.0)})
    assert synced == []


def _host(rank: int, world: int, init: str, path: str, second_host_has_tensors: bool) -> None:
    """One host of test_each_host_records_its_own_files: a collective save of its own tensor, or
    of none (the second host, when it has none of its own)."""
    import torch.distributed as dist

    from xtrain.checkpoint import io as ckpt_io

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    own = {f"host{rank}/w": torch.full((256,), float(rank))}
    tensors = ckpt_io.snapshot(own if rank == 0 or second_host_has_tensors else {}, sharded=False)
    ckpt_io.write(path, tensors, b"state", {"step": 1}, rank=rank, process_group=dist.group.WORLD)
    dist.destroy_process_group()


@pytest.mark.parametrize("second_host_has_tensors", [True, False], ids=["own", "none"])
def test_each_host_records_its_own_files(tmp_path, second_host_has_tensors):
    """A multi-host save (two gloo processes): each host describes the DCP file it wrote, the
    first gathers them into the one manifest. A host with nothing to save (on several TPU hosts,
    the replicated tensors are saved by the first alone) still gets a file from DCP, empty: it is
    described too, or every checkpoint of such a run would read as damaged."""
    import torch.multiprocessing as mp

    ckpt = tmp_path / "step_000001"
    mp.spawn(_host, args=(2, f"file://{tmp_path}/rendezvous", str(ckpt), second_host_has_tensors),
             nprocs=2)
    recorded = json.loads((ckpt / manifest.MANIFEST).read_text())["files"]
    written = sorted(p.name for p in (ckpt / "tensors").glob("*.distcp"))
    assert len(written) == 2 and sorted(f for f in recorded if f.endswith(".distcp")) == [
        f"tensors/{name}" for name in written]
    assert (recorded[f"tensors/{written[1]}"]["size"] == 0) is not second_host_has_tensors
    assert manifest.problems(str(ckpt)) == []
    with open(ckpt / "tensors" / written[1], "ab") as second:  # the second host's file
        second.write(b"!")
    (problem,) = manifest.problems(str(ckpt))
    assert problem.startswith(f"tensors/{written[1]} has ")


def _host_whose_storage_fails_once(rank: int, world: int, init: str, root: str) -> None:
    """One host of test_a_storage_error_on_one_host_fails_that_save_on_all_and_spares_the_next."""
    import time
    from datetime import timedelta

    import torch.distributed as dist

    from xtrain.checkpoint import io as ckpt_io

    # a storage error on one host only (a Cloud Storage 503 for its request) cannot be produced on
    # demand here (the emulator answers every process alike): the second host's first listing of
    # the files it wrote raises one, as gcsfs would
    failures = [OSError("503 from the bucket")] if rank == 1 else []
    describe = manifest.describe

    def flaky_describe(*args):
        if failures:
            raise failures.pop()
        return describe(*args)

    manifest.describe = flaky_describe
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world,
                            timeout=timedelta(seconds=30))
    outcomes = []
    for step in (1, 2):
        tensors = ckpt_io.snapshot({f"host{rank}/w": torch.full((256,), float(step))}, sharded=False)
        t0 = time.monotonic()
        try:
            ckpt_io.write(f"{root}/step_{step:06d}", tensors, b"state", {"step": step}, rank=rank,
                          process_group=dist.group.WORLD)
            outcomes.append(["committed", time.monotonic() - t0])
        except Exception as e:  # noqa: BLE001
            outcomes.append([f"{type(e).__name__}: {e}", time.monotonic() - t0])
    dist.destroy_process_group()
    Path(root, f"{rank}.json").write_text(json.dumps(outcomes))


def test_a_storage_error_on_one_host_fails_that_save_on_all_and_spares_the_next(tmp_path):
    """Two gloo processes; the second host's listing of its files fails once. That save fails
    on both hosts at once (not after the collective timeout, which would close the checkpoint
    group's connections and fail every later save), and the next save commits."""
    import torch.multiprocessing as mp

    mp.spawn(_host_whose_storage_fails_once, args=(2, f"file://{tmp_path}/rendezvous", str(tmp_path)),
             nprocs=2)
    (first0, second0), (first1, second1) = [json.loads((tmp_path / f"{r}.json").read_text())
                                            for r in range(2)]
    assert first1[0] == "OSError: 503 from the bucket"
    assert first0[0] == "RuntimeError: another process could not list the files it wrote"
    assert first0[1] < 15 and first1[1] < 15  # the timeout is 30 s
    assert not (tmp_path / "step_000001" / COMMIT_MARKER).exists()
    assert second0[0] == second1[0] == "committed"
    assert manifest.problems(str(tmp_path / "step_000002")) == []


def _host_that_finds_its_peer_gone(rank: int, world: int, init: str, root: str) -> None:
    """One host of test_a_failed_save_is_given_up_by_every_process_once_one_finds_a_peer_gone."""
    import time
    from datetime import timedelta

    import torch.distributed as dist

    from xtrain.checkpoint import io as ckpt_io

    def failing_describe(*args):  # every attempt fails on both hosts (shared by the collective)
        raise OSError("503 from the bucket")

    manifest.describe = failing_describe
    said = []
    ckpt_io.warn = said.append
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world,
                            timeout=timedelta(seconds=20))
    # which process a peer seems gone to is the heartbeat's answer (xtrain/engines/processes.py),
    # which a short network blip can give on one host alone; here the second host's function
    # says so, as it would then
    io = FsspecCheckpointIO(retries=3, backoff_s=0.1, rank=rank, process_group=dist.group.WORLD,
                            peer_lost=lambda: "rank 0 of 2: no heartbeat for 3 s" if rank else None)
    t0 = time.monotonic()
    io.save_checkpoint({"state_dict": {"w": torch.ones(256)}, "global_step": 1}, f"{root}/step_000001")
    outcome = io.wait()
    elapsed = time.monotonic() - t0
    dist.destroy_process_group()
    Path(root, f"{rank}.json").write_text(json.dumps([outcome, elapsed, said]))


def test_a_failed_save_is_given_up_by_every_process_once_one_finds_a_peer_gone(tmp_path):
    """Two gloo processes whose save fails; the second finds the first gone (a blip of its own)
    and gives up. The first gives up too, told so in the same vote, instead of retrying alone and
    waiting in the retry's first collective for a process that moved on (20 s here, for good)."""
    import torch.multiprocessing as mp

    mp.spawn(_host_that_finds_its_peer_gone, args=(2, f"file://{tmp_path}/rendezvous", str(tmp_path)),
             nprocs=2)
    for rank in range(2):
        outcome, elapsed, said = json.loads((tmp_path / f"{rank}.json").read_text())
        assert outcome is None and elapsed < 15, (rank, elapsed, said)
        assert not any("retrying" in line for line in said), said
        assert said[-1] == (f"giving up on checkpoint {tmp_path}/step_000001: rank 1: a process "
                            "vanished (rank 0 of 2: no heartbeat for 3 s); the previous checkpoint "
                            "stays the newest"), said
    assert not (tmp_path / "step_000001" / COMMIT_MARKER).exists()


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
    damaged = data.read_bytes()
    code, out, err = finish(xtrain(run_dir, *command))  # the same command again
    assert code == 0, err[-3000:]
    assert f"xtrain: warning: checkpoint {ckpts}/step_000020 is corrupt (tensors/{data.name} " in err
    assert "not resuming from it, trying the previous committed one" in err
    assert f"resuming from {ckpts}/step_000010" in out
    assert losses(run_dir) == first  # steps 11-20 again, the same losses
    assert_same_tensors(checkpoint_tensors(ckpts / "step_000020"), checkpoint_tensors(tmp_path / "intact_20"))
    # the damaged one is kept for inspection, renamed aside (not deleted by the new step 20)
    (aside,) = ckpts.glob("step_000020.corrupt-*")
    assert (aside / "tensors" / data.name).read_bytes() == damaged
    assert f"xtrain: warning: checkpoint {ckpts}/step_000020 (corrupt, passed over) renamed aside " \
           f"to {aside}: kept for inspection, not deleted" in err
    # and the run's own record says so (its console.log, each line timestamped)
    logged = (run_dir / "console.log").read_text()
    assert re.search(rf"^\S+ \S+ WARNING xtrain: xtrain: warning: checkpoint {re.escape(str(ckpts))}"
                     r"/step_000020 is corrupt ", logged, re.M), logged[-3000:]
    assert f"(corrupt, passed over) renamed aside to {aside}" in logged
