"""One training at a time in a checkpoint dir (xtrain/checkpoint/lease.py): a second training is
refused while the first renews its lease, and takes it over once the first is gone; a training
whose lease was taken over saves no more there. On a local dir and on the GCS emulator."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time

import pytest
import torch

from conftest import finish, xtrain
from xtrain.checkpoint import io as ckpt_io
from xtrain.checkpoint.layout import committed_checkpoints
from xtrain.checkpoint.lease import LEASE_FILE, CheckpointDirInUse, Lease, LeaseLost
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
    write_lease(directory, host=socket.gethostname(), pid=pid, lease_s=60.0)
    started = time.monotonic()
    lease = Lease(directory, "next", lease_s=2).acquire()
    try:
        assert time.monotonic() - started < 30  # not the dead holder's 60 s
        assert read_lease(directory)["holder"] == lease.mine["holder"]
        assert f"run other on {socket.gethostname()} (pid {pid}) no longer runs" in capsys.readouterr().err
    finally:
        lease.release()


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
