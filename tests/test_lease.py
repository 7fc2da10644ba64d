"""One training at a time in a checkpoint dir (xtrain/checkpoint/lease.py): a second training is
refused while the first renews its lease, and takes it over once the first is gone; a training
whose lease was taken over saves no more there. On a local dir and on the GCS emulator."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import finish, xtrain
from xtrain.checkpoint import io as ckpt_io
from xtrain.checkpoint.collective import check_fence
from xtrain.checkpoint.layout import committed_checkpoints
from xtrain.checkpoint.lease import LEASE_FILE, CheckpointDirInUse, Lease, LeaseLost, process_space
from xtrain.errors import EXIT_REFUSED
from xtrain.paths import url_to_fs


@pytest.fixture(params=["local", "gcs"])
def directory(request, tmp_path):
    if request.param == "local":
        return str(tmp_path / "ckpt")
    bucket, _ = request.getfixturevalue("gcs_bucket")
    return f"{bucket}/ckpt"


def read_lease(directory: str) -> dict | None:
    fs, root = url_to_fs(directory)
    fs.invalidate_cache()
    path = f"{root}/{LEASE_FILE}"
    return json.loads(fs.cat_file(path)) if fs.exists(path) else None


def write_lease(directory: str, **fields) -> None:
    fs, root = url_to_fs(directory)
    fs.makedirs(root, exist_ok=True)
    record = {"holder": "f" * 32, "run": "other", "host": "another-vm", "pid": 1,
              "renewed": time.time(), "lease_s": 600.0, **fields}
    fs.pipe_file(f"{root}/{LEASE_FILE}", json.dumps(record).encode())


def ended_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_a_renewed_lease_refuses_another_start_until_released(directory):
    holder = Lease(directory, "first", lease_s=2).acquire()
    try:
        assert read_lease(directory)["holder"] == holder.mine["holder"]
        with pytest.raises(CheckpointDirInUse) as refused:
            Lease(directory, "second", lease_s=2).acquire()
        assert (f"checkpoint.dir {directory} is in use: run first on {socket.gethostname()} "
                f"(pid {holder.mine['pid']}) renewed it just now") in str(refused.value)
        assert read_lease(directory)["holder"] == holder.mine["holder"]  # left as it was
    finally:
        holder.release()
    assert read_lease(directory) is None
    second = Lease(directory, "second", lease_s=2).acquire()  # free now: taken at once
    second.release()


def test_a_lease_whose_process_ended_on_this_host_is_taken_over_at_once(tmp_path, capsys):
    directory, pid = str(tmp_path / "ckpt"), ended_pid()
    write_lease(directory, host=socket.gethostname(), pid=pid, space=process_space(), lease_s=60.0)
    started = time.monotonic()
    lease = Lease(directory, "next", lease_s=2).acquire()
    try:
        assert time.monotonic() - started < 30  # not the dead holder's 60 s
        assert read_lease(directory)["holder"] == lease.mine["holder"]
        assert f"run other on {socket.gethostname()} (pid {pid}) no longer runs" in capsys.readouterr().err
    finally:
        lease.release()


def test_a_pid_of_another_pid_namespace_is_not_judged_here(tmp_path, capsys):
    """A container sharing the VM's hostname (host networking) has PID namespace of its own: its
    holder's pid names nothing here, yet it may be renewing. Its lease is watched for its term."""
    directory, pid = str(tmp_path / "ckpt"), ended_pid()
    write_lease(directory, host=socket.gethostname(), pid=pid, space="another-boot/4026531836",
                lease_s=3.0)
    started = time.monotonic()
    Lease(directory, "next", lease_s=2).acquire().release()
    assert time.monotonic() - started > 2.5  # watched (nobody renewed it, so then taken over)
    assert "no longer runs" not in capsys.readouterr().err


@pytest.mark.parametrize("content", [
    b"{not json", b"[1, 2]", b'{"holder": "h", "renewed": null, "lease_s": 60}',
    b'{"holder": "h", "renewed": 1e12, "lease_s": "long"}', b'{"renewed": 1e12, "lease_s": 60}'])
def test_a_lease_file_xtrain_did_not_write_is_replaced_with_a_warning(tmp_path, capsys, content):
    directory = str(tmp_path / "ckpt")
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / LEASE_FILE).write_bytes(content)
    lease = Lease(directory, "next", lease_s=60).acquire()
    try:
        assert f"{directory}/{LEASE_FILE} is not a lease xtrain wrote: replaced" in capsys.readouterr().err
        assert read_lease(directory)["holder"] == lease.mine["holder"]
    finally:
        lease.release()


def test_a_start_that_fails_after_writing_its_lease_leaves_none_behind(tmp_path, monkeypatch):
    """Its lease would hold the dir for lease_s against the next start on another host."""
    directory, reads = str(tmp_path / "ckpt"), []
    real_read = Lease.read

    def read_back_fails(self):
        reads.append(self.fs.exists(self.path))
        if len(reads) == 2:  # the read-back after writing
            raise OSError("503 from the bucket")
        return real_read(self)

    monkeypatch.setattr(Lease, "read", read_back_fails)
    with pytest.raises(OSError, match="503"):
        Lease(directory, "next", lease_s=2).acquire()
    assert reads[1] is True  # it was written
    assert read_lease(directory) is None


def test_another_hosts_lease_is_taken_over_once_it_expires_and_not_before(tmp_path, capsys):
    directory = str(tmp_path / "ckpt")
    write_lease(directory, renewed=time.time() - 100, lease_s=3.0)  # expired long ago
    started = time.monotonic()
    Lease(directory, "next", lease_s=2).acquire().release()
    assert time.monotonic() - started < 2
    assert "run other on another-vm (pid 1) last renewed it 100 s ago, past its 3.0 s" in capsys.readouterr().err

    write_lease(directory, renewed=time.time(), lease_s=3.0)  # fresh, but nobody renews it
    started = time.monotonic()
    lease = Lease(directory, "next", lease_s=2).acquire()
    try:
        assert time.monotonic() - started > 2  # watched it for its term first
        assert read_lease(directory)["holder"] == lease.mine["holder"]
    finally:
        lease.release()


def test_a_training_whose_lease_was_taken_over_saves_nothing_there(directory):
    lease = Lease(directory, "slow", lease_s=2).acquire()
    write_lease(directory)  # another start took it over (this one had not renewed in time)
    path = f"{directory}/step_000002"
    with pytest.raises(LeaseLost, match="is now held by run other on another-vm"):
        ckpt_io.write(path, {"w": torch.ones(3)}, b"", {"step": 2}, fence=lease.check)
    fs, root = url_to_fs(path)
    fs.invalidate_cache()
    assert not fs.exists(root)
    deadline = time.monotonic() + 10
    while lease.lost is None and time.monotonic() < deadline:  # its renewal sees it too
        time.sleep(0.1)
    assert lease.lost is not None and lease.lost["host"] == "another-vm"
    lease.release()
    assert read_lease(directory)["host"] == "another-vm"  # the new holder's lease stays


def test_a_second_training_on_one_checkpoint_dir_is_refused_and_a_killed_ones_is_taken_over(tmp_path):
    """Two trainings (in two run dirs, where the run dir's lock cannot see them) given one
    checkpoint.dir: the second is refused while the first renews its lease, before its data is
    prepared; once the first is killed (SIGKILL: its lease stays), the next start takes the
    lease over at once and resumes from the first's checkpoint."""
    ckpt = tmp_path / "ckpt"
    same = ["run.name=shared", f"checkpoint.dir={ckpt}", "checkpoint.lease_s=4", "checkpoint.every=2"]

    first = xtrain(tmp_path / "a", *same, "trainer.max_steps=100000")
    try:
        deadline = time.time() + 300
        while not committed_checkpoints(str(ckpt)):
            assert first.poll() is None, "the first training ended"
            assert time.time() < deadline, "the first training never committed a checkpoint"
            time.sleep(0.2)
        assert (ckpt / LEASE_FILE).exists()
        started = time.time()
        # (unrefused, it would resume from the first's checkpoint, past its end, and stop)
        code, out, err = finish(xtrain(tmp_path / "b", *same, "trainer.max_steps=1"))
        assert code == EXIT_REFUSED, err[-3000:]
        assert (f"checkpoint.dir {ckpt} is in use: run shared on {socket.gethostname()} "
                f"(pid {first.pid}) renewed it just now") in err
        assert "resuming from" not in out and time.time() - started < 60
    finally:
        first.kill()
        first.communicate()
    newest = committed_checkpoints(str(ckpt))[-1]
    code, out, err = finish(xtrain(tmp_path / "c", *same, f"trainer.max_steps={newest[0] + 1}"))
    assert code == 0, err[-3000:]
    assert f"(run shared on {socket.gethostname()} (pid {first.pid}) no longer runs)" in err
    assert f"resuming from {newest[1]}" in out
    assert not (ckpt / LEASE_FILE).exists()  # given back at the end


def test_a_lease_lost_during_a_write_leaves_it_uncommitted_and_the_next_save_raises(tmp_path):
    """Taken over while the tensors were written: the commit marker is not written, the upload
    is not retried (it cannot succeed), and the next save ends the training on its thread."""
    from xtrain.checkpoint.async_io import FsspecCheckpointIO

    fences = []

    def fence():  # holds for the check before the save and before the write, then is lost
        fences.append(time.monotonic())
        if len(fences) > 2:
            raise LeaseLost("checkpoint.dir is now held by run other")

    saver = FsspecCheckpointIO(retries=3, backoff_s=30.0)
    saver.fence = fence
    started = time.monotonic()
    saver.save_checkpoint({"w": torch.ones(3), "global_step": 2}, str(tmp_path / "step_000002"))
    assert saver.wait() is None and time.monotonic() - started < 20  # given up, no 30 s backoff
    assert len(fences) == 3
    assert list((tmp_path / "step_000002" / "tensors").glob("*.distcp"))  # written...
    assert committed_checkpoints(str(tmp_path)) == []  # ...not committed
    with pytest.raises(LeaseLost, match="now held by run other"):
        saver.save_checkpoint({"w": torch.ones(3), "global_step": 4}, str(tmp_path / "step_000004"))
    assert not (tmp_path / "step_000004").exists()


def test_retention_removes_nothing_once_the_lease_is_lost(tmp_path, capsys):
    """The training that took the dir over keeps its checkpoints, committed or being written."""
    from xtrain.checkpoint.async_io import FsspecCheckpointIO
    from xtrain.train.checkpointing import PeriodicCheckpoint

    for step in (2, 4, 6):
        ckpt_io.write(str(tmp_path / f"step_{step:06d}"), {"w": torch.ones(3)}, b"", {"step": step})
    (tmp_path / "step_000005").mkdir()  # the other training's save, being written
    saver = FsspecCheckpointIO()
    keeper = PeriodicCheckpoint(str(tmp_path), every=2, checkpoint_io=saver, keep_last=1)

    def lost():
        raise LeaseLost("checkpoint.dir is now held by run other")

    saver.fence = lost
    keeper._committed({"step": 6, "path": str(tmp_path / "step_000006")})
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "step_000002", "step_000004", "step_000005", "step_000006"]
    assert "no old checkpoint removed after this commit" in capsys.readouterr().err
    saver.fence = None  # (held: retention as usual)
    keeper._committed({"step": 6, "path": str(tmp_path / "step_000006")})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000006"]


def _host_whose_lease_is_lost(rank: int, world: int, init: str, root: str) -> None:
    """One process of test_a_lost_lease_ends_the_save_on_every_process."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    outcomes = []
    calls = []

    def fence():  # the first host's lease, lost before the commit of the first save
        calls.append(1)
        if len(calls) >= 3:
            raise LeaseLost("checkpoint.dir is now held by run other")

    tensors = {f"host{rank}/w": torch.ones(4)}
    for attempt in ("check", "write", "check"):
        try:
            if attempt == "check":
                check_fence(fence if rank == 0 else None, rank, dist.group.WORLD)
            else:
                ckpt_io.write(f"{root}/step_000002", tensors, b"", {"step": 2}, rank=rank,
                              process_group=dist.group.WORLD, fence=fence if rank == 0 else None)
            outcomes.append("passed")
        except Exception as e:  # noqa: BLE001
            outcomes.append(f"{type(e).__name__}: {e}")
    dist.destroy_process_group()
    (Path(root) / f"{rank}.json").write_text(json.dumps(outcomes))
    # The verdicts are written: end here. Under the full suite's load this child's interpreter
    # teardown, after this function returned, now and then aborted inside torch ("terminate called
    # without an active exception", no Python frame; 3 of 15 runs during a CI run, none alone).
    os._exit(0)


def test_a_lost_lease_ends_the_save_on_every_process(tmp_path):
    """Two gloo processes, the lease on the first: its loss is LeaseLost on both (never retried
    as a storage error would be), found before the commit or before a save."""
    import torch.multiprocessing as mp

    mp.spawn(_host_whose_lease_is_lost, args=(2, f"file://{tmp_path}/rendezvous", str(tmp_path)),
             nprocs=2)
    first, second = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(2)]
    assert first == ["passed", "LeaseLost: checkpoint.dir is now held by run other",
                     "LeaseLost: checkpoint.dir is now held by run other"]
    lost = "LeaseLost: the first process found the checkpoint dir's lease taken over"
    assert second == ["passed", lost, lost]
    assert committed_checkpoints(str(tmp_path)) == []


def test_a_training_whose_lease_is_taken_over_ends_at_its_next_save(tmp_path):
    """A real training (its lease renewed every second): another start takes the dir over (as it
    would after this one could not renew for lease_s); the training ends at its next save with
    a refusal naming the new holder, leaves the new holder's lease, and saves nothing more."""
    ckpt = tmp_path / "ckpt"
    run = xtrain(tmp_path / "a", f"checkpoint.dir={ckpt}", "checkpoint.lease_s=4",
                 "checkpoint.every=2", "trainer.max_steps=100000")
    try:
        deadline = time.time() + 300
        while not committed_checkpoints(str(ckpt)):
            assert run.poll() is None and time.time() < deadline, run.communicate()
            time.sleep(0.2)
        write_lease(str(ckpt))  # taken over
        before = committed_checkpoints(str(ckpt))[-1][0]
        code, _, err = finish(run, timeout=120)
    finally:
        run.kill()
    assert code == EXIT_REFUSED, err[-3000:]
    assert err.splitlines()[-1].startswith(
        f"xtrain: checkpoint error: checkpoint.dir {ckpt} is now held by run other on another-vm "
        "(pid 1)"), err[-3000:]
    assert read_lease(str(ckpt))["holder"] == "f" * 32  # neither renewed over nor released
    # (a save already past its check before the commit may still commit: one step of 2 at most)
    assert committed_checkpoints(str(ckpt))[-1][0] <= before + 2


def test_a_lease_taken_over_during_the_last_save_is_the_lease_refusal_not_a_failed_save(directory):
    """Taken over between a save's start and its commit: the final save (or a stop's) ended as
    "could not be written" (exit 1; a stop's 143, which a launcher re-runs into the lease's
    refusal). It is the lease's refusal, naming the new holder, as a periodic save's is at the
    next save. (The trainer is the one method of Lightning's a save calls.)"""
    from xtrain.checkpoint.async_io import FsspecCheckpointIO
    from xtrain.train.checkpointing import PeriodicCheckpoint

    lease, checks = Lease(directory, "slow", lease_s=60).acquire(), []
    checkpoint_io = FsspecCheckpointIO(retries=0)

    def fence():  # the save's start, its write's start, then before its commit marker
        checks.append(len(checks))
        if len(checks) == 3:
            write_lease(directory)  # another start took it over while the tensors were written
        lease.check()

    class Trainer:
        global_step = 40

        def save_checkpoint(self, path):
            checkpoint_io.save_checkpoint({"state_dict": {"w": torch.ones(2)}, "global_step": 40}, path)

    checkpoint_io.fence = fence
    saver = PeriodicCheckpoint(directory, 0, checkpoint_io, keep_last=1)
    try:
        with pytest.raises(LeaseLost, match="is now held by run other on another-vm"):
            saver.save(Trainer(), wait=True)
        assert len(checks) == 3 and not committed_checkpoints(directory)
    finally:
        lease.release()
