"""The CPU engine on two processes (Lightning DDP over gloo on 127.0.0.1): the same training as one
process, one writer, a stop on any process stopping both at the same step, and a vanished process
named. Every run is real processes, started with torchrun or with the standard variables
(MASTER_ADDR, MASTER_PORT, WORLD_SIZE, RANK), as the SSH launchers start them on several hosts."""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from datetime import datetime, timedelta
from pathlib import Path

import pytest
import torch

from conftest import read_jsonl, with_fault
from test_checkpoint import losses, wait_for_step
from test_evals_model import PROBLEMS
from xtrain.checkpoint.layout import committed_checkpoints
from xtrain.errors import EXIT_STOPPED

ROOT = Path(__file__).resolve().parent.parent
STEPS = 20
COMMON = ["model=d2", "model.sequence_len=64", "trainer.log_every=1", "trainer.sample_tokens=0",
          "trainer.eval_tokens=512", "optim.warmup_steps=3", f"trainer.max_steps={STEPS}"]
ONE = ["hardware=cpu", "trainer.device_batch_size=8"]  # the global batch: 8 rows of 64 tokens
TWO = ["hardware=cpu2", "trainer.device_batch_size=4"]  # the same 8 rows, 4 per process
# two processes on two cores: one thread each (torchrun sets the same)
ENV = {"OMP_NUM_THREADS": "1", "WANDB_MODE": "offline"}


def free_port() -> int:
    """A port for a run's store, which binds it seconds later: one below the kernel's ephemeral
    range, so that no outgoing connection (gloo's, a store client's) is given it meanwhile."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    for port in random.sample(range(max(1024, low - 10000), low), 100):
        with socket.socket() as s:
            try:
                s.bind(("", port))  # every address, as the store binds it
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port below {low}")


def start(cmd, env=None, cwd=ROOT):
    return subprocess.Popen(cmd, cwd=cwd, env={**os.environ, **ENV, **(env or {})},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def xtrain_processes(run_dir, *overrides, env=None, port=None, ranks=(0, 1), cwd=ROOT) -> list[subprocess.Popen]:
    """Two `python -m xtrain` processes joined by the standard variables (``ranks``: of those)."""
    launch = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port or free_port()), "WORLD_SIZE": "2"}
    cmd = [sys.executable, "-m", "xtrain", *COMMON, *TWO, *overrides, f"hydra.run.dir={run_dir}"]
    return [start(cmd, {**launch, **(env or {}), "RANK": str(rank)}, cwd) for rank in ranks]


def finish_all(procs, timeout=300) -> list[tuple[int, str, str]]:
    outputs = [p.communicate(timeout=timeout) for p in procs]
    return [(p.returncode, *output) for p, output in zip(procs, outputs)]


def cpp_eval_overrides(root: Path) -> list[str]:
    """A two-problem C++ benchmark (tests/test_evals_model.py's), judged greedily."""
    problems = root / "cpp.jsonl"
    problems.write_text("".join(json.dumps(p) + "\n" for p in PROBLEMS))
    return [f"eval.cpp_file={problems}", "eval.max_tokens=8", "eval.n=1", "eval.k=[1]"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One process on 8 rows per step, and two processes (torchrun) on 4 rows each; both dump
    their final parameters, their rows and their first step's tokens (xtrain/train/debug_dump.py).
    The two-process run also evaluates the C++ benchmark every 10 steps, from its checkpoints."""
    root = tmp_path_factory.mktemp("reference")
    for name in ("one", "two"):
        (root / f"{name}-dump").mkdir()
    one = start([sys.executable, "-m", "xtrain", *COMMON, *ONE, f"hydra.run.dir={root / 'one'}"],
                {"XTRAIN_DEBUG_DUMP": str(root / "one-dump")})
    code, _, err = finish_all([one])[0]
    assert code == 0, err[-3000:]
    evaluation = [*cpp_eval_overrides(root), "eval.cpp_every=10", "checkpoint.every=10"]
    two = start([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                 "2", "-m", "xtrain", *COMMON, *TWO, *evaluation, f"hydra.run.dir={root / 'two'}"],
                {"XTRAIN_DEBUG_DUMP": str(root / "two-dump")})
    code, out, err = finish_all([two])[0]
    assert code == 0, err[-3000:]
    return root


SLOW_EVALUATION = with_fault("""
import time
import xtrain.train.cpp_eval as cpp_eval
judge = cpp_eval.evaluate_model
def slow(*args, **kwargs):  # as a large model generating on a host's CPU
    time.sleep(8)
    return judge(*args, **kwargs)
cpp_eval.evaluate_model = slow
""")


def test_an_evaluation_longer_than_the_collective_timeout_holds_no_process(tmp_path):
    """Process 0 judges the C++ benchmark in the background; an evaluation slower than
    trainer.collective_timeout_s (here 8 s against 4; a fault injected into the real one) once
    ended the run: the other process timed out in the gradient all-reduce while process 0 waited
    for the running evaluation at the next one due, or in the end's broadcast while it waited for
    the last. Now one due meanwhile is skipped, the last deferred, and the end waits on the store."""
    run = tmp_path / "run"
    overrides = [*cpp_eval_overrides(tmp_path), "eval.cpp_every=5", "checkpoint.every=5",
                 "checkpoint.keep_last=5", "trainer.max_steps=15", "trainer.collective_timeout_s=4"]
    launch = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2"}
    cmd = [sys.executable, "-c", SLOW_EVALUATION, *COMMON, *TWO, *overrides, f"hydra.run.dir={run}"]
    procs = [start(cmd, {**launch, "RANK": str(rank)}) for rank in (0, 1)]
    results = finish_all(procs)
    assert [code for code, _, _ in results] == [0, 0], [err[-2000:] for _, _, err in results]
    evals = [r["step"] for r in read_jsonl(run / "metrics.jsonl") if r["kind"] == "eval"]
    assert evals == [5, 15], evals
    assert "C++ evaluation of step 10 skipped: step 5's still runs" in results[0][2]


FAILING_COMMITS = with_fault("""
import xtrain.checkpoint.io as io
def failing(*args):  # as storage that breaks for good (a full disk, a bucket turned read-only)
    raise OSError("injected: the bucket refused the write")
io._commit = failing
""")


def test_evaluations_waiting_for_checkpoints_do_not_hold_an_end_whose_save_gave_up(tmp_path):
    """On several processes an evaluation reads its step's checkpoint once committed. Here storage
    breaks for good: step 5's save gives up while its evaluation waits for it, step 10's (the
    last) is deferred behind it, and the end's save gives up too. Nothing commits any more, and
    the end waited an hour (COMMIT_WAIT_S) before the run failed; now both are skipped at once
    and the run fails with the final save's error. The commits fail by a fault injected into the
    real save (storage that breaks mid-run cannot be made here)."""
    run = tmp_path / "run"
    err = _both_fail_their_final_save(FAILING_COMMITS, run, *cpp_eval_overrides(tmp_path),
                                      "eval.cpp_every=5")
    for step in (5, 10):
        assert (f"C++ evaluation of step {step} skipped: {run}/checkpoints/step_{step:06d} was not "
                "committed") in err
    assert not [r for r in read_jsonl(run / "metrics.jsonl") if r["kind"] == "eval"]


SLOW_SAMPLE = """
import time
import xtrain.train.sampling as sampling
generate = sampling.generate
def slow(*args, **kwargs):  # as a large model's sample on a host's CPU
    time.sleep(8)
    return generate(*args, **kwargs)
sampling.generate = slow
"""


def test_a_final_save_that_gave_up_on_every_process_is_that_error_on_every_process(tmp_path):
    """Every process finds the final save given up, and each fails with it (exit 1). Process 0
    got there 8 s later, after the end's sample (its own work), and found process 1 gone by
    then: it called that a lost peer (exit 3), and the run's log blamed process 1."""
    err = _both_fail_their_final_save(SLOW_SAMPLE + FAILING_COMMITS, tmp_path / "run",
                                      "trainer.sample_tokens=8")
    assert "peer error" not in err


def _both_fail_their_final_save(script: str, run, *overrides) -> str:
    """Two processes of ``script`` (with FAILING_COMMITS' faults) that train 10 steps, saving
    every 5: both must fail for the final save (exit 1). Process 0's stderr."""
    launch = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2"}
    cmd = [sys.executable, "-c", script, *COMMON, *TWO, "checkpoint.every=5", "trainer.max_steps=10",
           "checkpoint.retries=0", *overrides, f"hydra.run.dir={run}"]
    procs = [start(cmd, {**launch, "RANK": str(rank)}) for rank in (0, 1)]
    try:
        results = finish_all(procs, timeout=240)
    finally:
        for p in procs:
            p.kill()
    assert [code for code, _, _ in results] == [1, 1], [err[-2000:] for _, _, err in results]
    err = results[0][2]
    assert ("xtrain: checkpoint error: training reached step 10, but its final checkpoint could "
            "not be written") in err
    return err


def test_two_processes_train_the_one_process_batch_with_one_writer(reference):
    one, two = losses(reference / "one"), losses(reference / "two")
    assert sorted(two) == list(range(1, STEPS + 1))
    # each process averages the gradients of its 4 rows, then DDP averages the two: the same
    # mean as over 8 rows, summed in another order
    assert max(abs(two[s] - one[s]) / one[s] for s in one) <= 1e-5
    assert two[STEPS] < two[1] - 2.0
    records = read_jsonl(reference / "two" / "metrics.jsonl")  # written by rank 0 alone
    train_steps = [r["step"] for r in records if "loss" in r]
    assert train_steps == list(range(1, STEPS + 1))
    assert [s for s, _ in committed_checkpoints(str(reference / "two" / "checkpoints"))] == [10, STEPS]
    # MFU: each process (a host of its own, in a real run) brings the CPU peak rank 0 measured
    console = (reference / "two" / "console.log").read_text()
    assert "GFLOP/s x 2 processes, measured" in console
    assert console.count("param_checksum") == 1  # process 0's log alone (both print one)
    ranks = [torch.load(reference / "two-dump" / f"rank{r}.pt", weights_only=True) for r in (0, 1)]
    assert ranks[0]["params"].keys() == ranks[1]["params"].keys()
    for name, tensor in ranks[0]["params"].items():  # DDP replicas: bitwise the same
        assert torch.equal(tensor, ranks[1]["params"][name]), name
    rows = [range(*d["rows"]) for d in ranks]
    assert not set(rows[0]) & set(rows[1]) and sorted([*rows[0], *rows[1]]) == list(range(8))
    single = torch.load(reference / "one-dump" / "rank0.pt", weights_only=True)
    assert single["first_tokens"].shape[0] == 8
    for d in ranks:  # each process trained on its own rows of the one-process run's batch
        assert torch.equal(d["first_tokens"], single["first_tokens"][slice(*d["rows"])])


def test_two_processes_judge_cpp_from_the_checkpoint_of_each_evaluated_step(reference, tmp_path):
    """On more than one process a host may hold only its shards (a TPU pod), so rank 0 reads each
    evaluated step's weights from its checkpoint: what it judged is what ``mode=eval`` judges
    from that checkpoint, completion for completion."""
    run = reference / "two"
    evals = [r for r in read_jsonl(run / "metrics.jsonl") if r["kind"] == "eval"]
    assert [r["step"] for r in evals] == [10, STEPS]
    assert all("cpp_snapshot_seconds" not in r for r in evals)  # no copy of the live model
    # the two steps' completions differ, so a step judged with the other's weights would show
    codes = [[p["code"] for p in read_jsonl(run / f"cpp_eval/step_{r['step']:06d}.jsonl")] for r in evals]
    assert codes[0] != codes[1]
    for record in evals:
        step = record["step"]
        alone = tmp_path / f"alone{step}"
        r = subprocess.run([sys.executable, "-m", "xtrain", "mode=eval", *cpp_eval_overrides(tmp_path),
                            f"checkpoint.resume={run}/checkpoints/step_{step:06d}",
                            f"hydra.run.dir={alone}"], cwd=ROOT, capture_output=True, text=True,
                           timeout=300, env={**os.environ, **ENV})
        assert r.returncode == 0, r.stderr[-3000:]
        (alone_records,) = (alone / "cpp_eval").glob(f"step_{step:06d}-eval-*.jsonl")  # mode=eval's
        during, after = read_jsonl(run / f"cpp_eval/step_{step:06d}.jsonl"), read_jsonl(alone_records)
        assert len(during) == len(PROBLEMS)
        assert [(p["id"], p["code"], p["outcome"]) for p in during] == \
            [(p["id"], p["code"], p["outcome"]) for p in after]


def test_two_processes_resumed_at_the_last_step_run_only_the_end_their_log_lacks(reference, tmp_path):
    """A run stopped after its last step's commit, before its final validation and C++ evaluation
    were recorded (xtrain/train/finish.py; here their records taken out of a copy of the run):
    run again, both processes validate together and process 0 alone judges the benchmark, as
    in training; each record once, with the figures the run had given at that step."""
    run = tmp_path / "two"
    shutil.copytree(reference / "two", run)
    records = read_jsonl(run / "metrics.jsonl")
    ended = {r["kind"]: r for r in records if r["step"] == STEPS and r["kind"] in ("val", "eval")}
    assert set(ended) == {"val", "eval"}
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records
                                               if r["step"] != STEPS or r["kind"] not in ended))
    evaluation = [*cpp_eval_overrides(reference), "eval.cpp_every=10", "checkpoint.every=10"]
    code, out, err = finish_all([start([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                        "--nproc-per-node", "2", "-m", "xtrain", *COMMON, *TWO,
                                        *evaluation, f"hydra.run.dir={run}"])])[0]
    assert code == 0, err[-3000:]
    assert f"step {STEPS}, the last, was trained before this command, but its val, eval were not recorded" in out
    again = [r for r in read_jsonl(run / "metrics.jsonl") if r["step"] == STEPS and r["kind"] in ended]
    assert sorted(r["kind"] for r in again) == ["eval", "val"]
    for r in again:
        figures = {k: v for k, v in r.items()  # (timings apart)
                   if k != "time" and not k.endswith(("_s", "seconds"))}
        assert figures == {k: v for k, v in ended[r["kind"]].items() if k in figures}, (r, ended[r["kind"]])
        assert len(figures) > 2, figures  # (more than step and kind)


def test_two_processes_resumed_at_a_periodic_step_make_its_records_before_training_on(reference,
                                                                                    tmp_path):
    """A stop commits its step's checkpoint and ends before that step's validation and C++
    evaluation (xtrain/train/catch_up.py; here the run cut back to step 10). Run again, both
    processes validate together before step 11 (inside fit) and process 0 judges step 10's
    weights; the steps after train as before, to the same end."""
    run = tmp_path / "two"
    shutil.copytree(reference / "two", run)
    shutil.rmtree(run / "checkpoints" / f"step_{STEPS:06d}")
    records = read_jsonl(run / "metrics.jsonl")
    (run / "metrics.jsonl").write_text("".join(
        json.dumps(r) + "\n" for r in records
        if r["step"] < 10 or (r["step"] == 10 and r["kind"] in ("train", "checkpoint"))))
    evaluation = [*cpp_eval_overrides(reference), "eval.cpp_every=10", "checkpoint.every=10",
                  "trainer.eval_every=10"]  # (a validation due at step 10 too)
    code, out, err = finish_all([start([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                        "--nproc-per-node", "2", "-m", "xtrain", *COMMON, *TWO,
                                        *evaluation, f"hydra.run.dir={run}"])])[0]
    assert code == 0, err[-3000:]
    assert "step 10 was trained before this command, but its val, eval were not recorded" in out
    again = read_jsonl(run / "metrics.jsonl")
    assert [r["step"] for r in again if r["kind"] == "val"] == [10, STEPS]
    assert sorted(r["step"] for r in again if r["kind"] == "eval") == [10, STEPS]
    for kind, step in (("eval", 10), ("val", STEPS), ("eval", STEPS)):
        (before,) = [r for r in records if (r["kind"], r["step"]) == (kind, step)]
        (after,) = [r for r in again if (r["kind"], r["step"]) == (kind, step)]
        figures = [k for k in before if k != "time" and not k.endswith(("_s", "seconds"))]
        assert {k: after[k] for k in figures} == {k: before[k] for k in figures}, kind
    assert losses(run) == losses(reference / "two")


def stop_step(out: str) -> int:
    return int(re.search(r"stopped \(.*\) at step (\d+)", out).group(1))


def test_sigterm_to_rank_1_stops_both_at_one_step_and_resumes_bitwise(reference, tmp_path):
    for attempt in range(3):
        run = tmp_path / f"run{attempt}"
        procs = xtrain_processes(run)
        wait_for_step(run, 8, procs[0])
        procs[1].send_signal(signal.SIGTERM)  # the notice reaches one process only
        (code0, out0, err0), (code1, out1, err1) = finish_all(procs)
        # a run that trained its last step got the signal too late: this process was kept off
        # the cores for the 12 steps left (about a second); the race, not the handling. A
        # swallowed signal trains to the end too, on every attempt.
        if max(losses(run)) < STEPS:
            break
    assert (code0, code1) == (143, 143), err0[-2000:] + err1[-2000:]
    assert "stopped (SIGTERM)" in out1 and "stopped (another process was told to stop)" in out0
    stopped_at = stop_step(out0)
    assert stop_step(out1) == stopped_at and 8 <= stopped_at < STEPS
    assert [s for s, _ in committed_checkpoints(str(run / "checkpoints"))] == [stopped_at]
    # rank 0 records why, agreed over the processes; the signal's name stayed with rank 1
    stop = read_jsonl(run / "metrics.jsonl")[-1]
    assert (stop["kind"], stop["step"], stop["stopped_for"]) == ("stop", stopped_at, "signal")
    assert "stop_reason" not in stop
    results = finish_all(xtrain_processes(run))  # the same command again
    assert [code for code, _, _ in results] == [0, 0], results[0][2][-2000:] + results[1][2][-2000:]
    assert f"resuming from {run}/checkpoints/step_{stopped_at:06d}" in results[0][1]
    resumed, straight = losses(run), losses(reference / "two")
    assert sorted(resumed) == list(range(1, STEPS + 1))
    assert all(resumed[s] == straight[s] for s in straight)  # bitwise


def test_sigkill_of_one_rank_is_named_and_the_newest_checkpoint_resumes(tmp_path):
    run, timeout = tmp_path / "run", 60
    # 50 steps after the kill's (about 4 s): with 10, a test kept off the cores for a second let
    # rank 0 train to the end and exit 0
    steps = 3 * STEPS
    overrides = ["checkpoint.every=5", f"trainer.collective_timeout_s={timeout}",
                 f"trainer.max_steps={steps}"]
    procs = xtrain_processes(run, *overrides)
    metrics = run / "metrics.jsonl"
    deadline = time.time() + 240
    while not (metrics.exists() and any(r.get("ckpt_s") and r["step"] == 10 for r in read_jsonl(metrics))):
        assert procs[0].poll() is None and time.time() < deadline, procs[0].communicate()[1][-3000:]
        time.sleep(0.05)
    procs[1].kill()  # SIGKILL: rank 1 vanishes without a word
    killed_at = time.time()
    code, _, err = finish_all(procs[:1], timeout=timeout + 30)[0]
    procs[1].wait()
    assert code == 3 and time.time() - killed_at < timeout, err[-3000:]
    assert "xtrain: peer error: lost rank 1 of 2: no heartbeat" in err
    committed = [s for s, _ in committed_checkpoints(str(run / "checkpoints"))]
    assert committed and committed[-1] >= 10
    results = finish_all(xtrain_processes(run, *overrides))
    assert [code for code, _, _ in results] == [0, 0], results[0][2][-2000:] + results[1][2][-2000:]
    assert f"resuming from {run}/checkpoints/step_{committed[-1]:06d}" in results[0][1]
    assert max(losses(run)) == steps


FAILING_RANK_1 = with_fault("""
import os
from xtrain.train.module import GPTModule
step = GPTModule.training_step
def failing(self, batch, batch_idx):  # a fault injected into rank 1's real step
    if os.environ["RANK"] == "1" and self.trainer.global_step == 5:
        raise RuntimeError("injected on rank 1 at step 5")
    return step(self, batch, batch_idx)
GPTModule.training_step = failing
""")


def test_a_ranks_own_error_is_named_in_the_runs_log(tmp_path):
    """Rank 1 fails with an error of its own: rank 0, whose log is the run's, says which rank was
    lost and also why (it said only "lost rank 1"; the cause was in rank 1's own log alone)."""
    run = tmp_path / "run"
    launch = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2"}
    cmd = [sys.executable, "-c", FAILING_RANK_1, *COMMON, *TWO, f"hydra.run.dir={run}"]
    procs = [start(cmd, {**launch, "RANK": str(rank)}) for rank in (0, 1)]
    (code0, _, err0), (code1, _, err1) = finish_all(procs, timeout=240)
    assert code1 != 0 and "injected on rank 1 at step 5" in err1, err1[-2000:]
    assert code0 == 3, err0[-2000:]
    assert ("xtrain: peer error: lost rank 1 of 2: no heartbeat for 3 s (its error, rank 1: "
            "RuntimeError: injected on rank 1 at step 5)") in err0
    assert "injected on rank 1 at step 5" in (run / "console.log").read_text()


RANK_0_FAILS_AT_ITS_END = with_fault("""
import os, time
from xtrain.observe.sinks import RunLog
close = RunLog.close
def failing(self, status="success"):  # after the last collective: rank 0's own work
    close(self, status)
    if os.environ["RANK"] == "0":
        time.sleep(5)  # (a slow upload: rank 1 has ended meanwhile, its heartbeat stopped)
        raise OSError("503 uploading metrics.jsonl")
RunLog.close = failing
""")


def test_an_error_of_rank_0s_own_after_the_last_collective_is_not_a_lost_peer(tmp_path):
    """Rank 0's end (the run log's upload, W&B's finish) fails after rank 1 finished and left:
    the error is rank 0's own, said as itself, not a lost rank 1 (exit 3, which a launcher reads
    as a host to replace)."""
    run = tmp_path / "run"
    launch = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2"}
    cmd = [sys.executable, "-c", RANK_0_FAILS_AT_ITS_END, *COMMON, *TWO, "trainer.max_steps=4",
           f"hydra.run.dir={run}"]
    procs = [start(cmd, {**launch, "RANK": str(rank)}) for rank in (0, 1)]
    (code0, _, err0), (code1, _, err1) = finish_all(procs, timeout=240)
    assert code1 == 0, err1[-2000:]
    assert code0 not in (0, 3) and "503 uploading metrics.jsonl" in err0, err0[-2000:]
    assert "lost rank 1" not in err0, err0[-2000:]


def test_a_process_whose_peer_never_joins_says_so_within_the_timeout(tmp_path):
    """Rank 0 started without rank 1, and rank 1 without rank 0 (each as if the other's host
    refused its command at start): each ends as a lost peer (exit 3), saying what it waited for."""
    timeout = 5
    (alone0,), (alone1,) = [xtrain_processes(tmp_path / f"run{rank}", f"trainer.collective_timeout_s={timeout}",
                                             ranks=(rank,)) for rank in (0, 1)]
    (code0, _, err0), (code1, _, err1) = finish_all([alone0, alone1], timeout=120)
    assert (code0, code1) == (3, 3), err0[-2000:] + err1[-2000:]
    assert "xtrain: peer error: not every process of 2 joined rank 0's store at 127.0.0.1:" in err0
    assert "xtrain: peer error: rank 0's store at 127.0.0.1:" in err1
    assert f"within trainer.collective_timeout_s={timeout} s" in err0 and "Traceback" not in err0 + err1


def test_a_sigterm_while_waiting_for_a_peer_stops_the_process_at_once(tmp_path):
    """Rank 0 waits at the rendezvous for a rank 1 that never comes (its host failed at start);
    the launcher then stops it: the SIGTERM takes effect at once, not when the wait times out
    (it did, 10 minutes later, and the launcher's grace ran out first)."""
    port = free_port()
    (alone,) = xtrain_processes(tmp_path / "run", "trainer.collective_timeout_s=600", port=port,
                                ranks=(0,))
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # until rank 0's store listens: it is in the rendezvous
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                break
        assert alone.poll() is None, alone.communicate()[1][-2000:]
        time.sleep(0.2)
    time.sleep(1)
    sent = time.monotonic()
    alone.send_signal(signal.SIGTERM)
    ((code, _, err),) = finish_all([alone], timeout=60)
    assert code == EXIT_STOPPED, err[-2000:]
    assert time.monotonic() - sent < 30
    assert "xtrain: stopped (SIGTERM) outside a training step" in err, err[-2000:]


def test_corpus_builds_longer_than_the_collective_timeout_are_waited_for(tmp_path):
    """Hosts with disks of their own (a pod's VMs): a first corpus build on rank 0 outlasting
    trainer.collective_timeout_s, rank 1 waits for it (a barrier timed out, both ended with gloo's
    traceback); then rank 1 builds its own copy, as long, and rank 0 waits for it (a collective
    timed out: seen in CI as rank 1 merely loaded rank 0's build); the run then trains."""
    sources = tmp_path / "sources"
    shutil.copytree("/usr/include/c++", sources, ignore=shutil.ignore_patterns("*tr1*", "*ext*"))
    # one relative build dir, in each process's own working dir: one config, two disks
    data = [f"data.build_sources=[{sources}]", "data.vocab_size=512", "data.build_dir=corpus",
            "trainer.max_steps=2", "trainer.collective_timeout_s=3"]
    port = free_port()
    for rank in (0, 1):
        (tmp_path / f"host{rank}").mkdir()
    procs = [proc for rank in (0, 1) for proc in xtrain_processes(
        tmp_path / "run", *data, env={"PYTHONPATH": str(ROOT)}, port=port, ranks=(rank,),
        cwd=tmp_path / f"host{rank}")]
    (code0, _, err0), (code1, _, err1) = finish_all(procs)
    assert (code0, code1) == (0, 0), err0[-2000:] + err1[-2000:]
    # each build did outlast the timeout: rank 0's from its first line to its tokenizer's last
    # write, rank 1's (which began after) from rank 0's end to its own
    [began] = [datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()
               for line in (tmp_path / "run" / "console.log").read_text().splitlines()
               if "building C++ corpus" in line]
    built0, built1 = [tmp_path / f"host{rank}" / "corpus" / "tokenizer" / "tokenizer.json"
                      for rank in (0, 1)]
    assert built0.stat().st_mtime - began > 3 and built1.stat().st_mtime - built0.stat().st_mtime > 3
    assert max(losses(tmp_path / "run")) == 2


def test_another_ranks_refused_data_preparation_is_refused_on_rank_0(tmp_path):
    """Rank 1, on a disk of its own, builds from sources too small for a corpus after rank 0
    built its own: its refusal is rank 0's too, naming rank 1 (not a collective's timeout)."""
    [bits] = Path("/usr/include/c++").glob("*/bits")
    shutil.copytree(bits, tmp_path / "host0" / "sources")
    (tmp_path / "host1" / "sources").mkdir(parents=True)
    for name in ("a.cpp", "b.cpp"):
        (tmp_path / "host1" / "sources" / name).write_text("int main() { return 0; }\n")
    data = ["data.build_sources=[sources]", "data.vocab_size=512", "data.build_dir=corpus"]
    port = free_port()
    procs = [proc for rank in (0, 1) for proc in xtrain_processes(
        tmp_path / "run", *data, env={"PYTHONPATH": str(ROOT)}, port=port, ranks=(rank,),
        cwd=tmp_path / f"host{rank}")]
    (code0, _, err0), (code1, _, err1) = finish_all(procs, timeout=240)
    assert (code0, code1) == (2, 2), err0[-2000:] + err1[-2000:]  # a refusal on every process
    [refusal] = [line for line in err1.splitlines() if line.startswith("xtrain: data error: ")]
    assert f"xtrain: data error: rank 1: {refusal[len('xtrain: data error: '):]}" in err0
    assert (tmp_path / "host0" / "corpus" / "tokenizer" / "tokenizer.json").exists()


def test_rank_0s_refused_data_preparation_is_refused_on_the_others(tmp_path):
    (tmp_path / "sources").mkdir()  # C++ files too small to build a corpus from
    for name in ("a.cpp", "b.cpp"):
        (tmp_path / "sources" / name).write_text("int main() { return 0; }\n")
    procs = xtrain_processes(tmp_path / "run", f"data.build_sources=[{tmp_path / 'sources'}]",
                             env={"XTRAIN_CACHE": str(tmp_path / "cache")})
    (code0, _, err0), (code1, _, err1) = finish_all(procs, timeout=120)
    assert (code0, code1) == (2, 2), err0[-2000:] + err1[-2000:]  # a refusal on every process
    [refusal] = [line for line in err0.splitlines() if line.startswith("xtrain: data error: ")]
    assert f"xtrain: data error: rank 0: {refusal[len('xtrain: data error: '):]}" in err1


def _primary_first_twice(rank: int, world: int, port: int, out: str) -> None:
    """One process of test_each_wait_for_rank_0_waits_for_its_own_work."""
    from xtrain.engines.processes import join_gloo

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    processes = join_gloo(rank, world, 30, f"127.0.0.1:{port}")

    def work(n: int) -> None:
        time.sleep(n * 2)  # the second one slower: a waiting process must not take the first's outcome
        Path(out, f"done{n}").touch()

    seen = []
    for n in (0, 1):
        processes.primary_first("the same work", lambda: work(n))
        seen.append(Path(out, f"done{n}").exists())
    processes.barrier()  # rank 0's store stays up until both have read every outcome
    processes.close()
    Path(out, f"{rank}.json").write_text(json.dumps(seen))


def test_each_wait_for_rank_0_waits_for_its_own_work(tmp_path):
    """Two waits of one name in one run (as a sweep's jobs in one process make, or workers
    restarted under torchrun, whose store outlives them): each waits for its own work."""
    import torch.multiprocessing as mp

    mp.spawn(_primary_first_twice, args=(2, free_port(), str(tmp_path)), nprocs=2)
    assert json.loads((tmp_path / "1.json").read_text()) == [True, True]


def test_processes_given_different_configs_are_refused_naming_the_keys(tmp_path):
    launch = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2"}
    cmd = [sys.executable, "-m", "xtrain", *COMMON, *TWO, f"hydra.run.dir={tmp_path / 'run'}"]
    extra = {0: [], 1: ["optim.matrix_lr=0.05", "trainer.max_steps=30"]}
    procs = [start(cmd + extra[rank], {**launch, "RANK": str(rank)}) for rank in (0, 1)]
    (code0, _, err0), (code1, _, err1) = finish_all(procs, timeout=120)
    assert (code0, code1) == (2, 2), err0[-2000:] + err1[-2000:]
    for err in (err0, err1):
        assert ("xtrain: config error: rank 1 of 2 has another config than rank 0 (rank 1: "
                "optim.matrix_lr, run.name, trainer.max_steps)") in err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_processes_running_other_code_or_reading_other_shards_are_refused(tmp_path):
    """Every process packs the same global batch and trains a replica. One started from another
    checkout (here, a comment added) trained another model into the same checkpoint; one whose
    copy of the corpus lacks a shard packed its rows in another order from batch 95 on: both
    trained silently, found only at a resume. Refused before the first step, naming the fact."""
    from conftest import compose_cfg
    from xtrain.data import prepare

    other = tmp_path / "other"  # another checkout: the package and its configs
    shutil.copytree(ROOT / "xtrain", other / "xtrain", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(ROOT / "conf", other / "conf")
    with open(other / "xtrain" / "optim.py", "a") as f:
        f.write("# changed in this checkout\n")
    port = free_port()
    procs = [xtrain_processes(tmp_path / "code", env={"PYTHONPATH": str(tree)}, port=port, ranks=(rank,),
                              cwd=tree)[0] for rank, tree in ((0, ROOT), (1, other))]
    results = finish_all(procs, timeout=120)
    assert [code for code, _, _ in results] == [2, 2], [err[-2000:] for _, _, err in results]
    for _, _, err in results:
        assert "rank 1 of 2 has another code than rank 0 (rank 1: xtrain source)" in err
    # each host's own copy of one corpus, found at one relative path; host 1's lacks a shard
    data = compose_cfg([*COMMON, *TWO]).data
    prepare(data, log=lambda *_: None)
    for rank in (0, 1):
        shutil.copytree(data.build_dir, tmp_path / f"host{rank}" / "corpus")
    (tmp_path / "host1" / "corpus" / "train" / "shard_00001.parquet").unlink()
    copies = ["data.train_files=corpus/train", "data.val_files=corpus/val",
              "data.tokenizer=corpus/tokenizer", "data.build_sources=[]"]
    port = free_port()
    procs = [xtrain_processes(tmp_path / "data", *copies, env={"PYTHONPATH": str(ROOT)}, port=port,
                              ranks=(rank,), cwd=tmp_path / f"host{rank}")[0] for rank in (0, 1)]
    results = finish_all(procs, timeout=120)
    assert [code for code, _, _ in results] == [2, 2], [err[-2000:] for _, _, err in results]
    for _, _, err in results:
        assert "rank 1 of 2 has another data than rank 0 (rank 1: train)" in err
    assert not (tmp_path / "data" / "metrics.jsonl").exists()


def test_a_stop_checkpoint_committed_as_a_rank_dies_is_kept_and_recorded(tmp_path):
    """SIGTERM to both; rank 1 killed once every host's files are written and rank 0 holds the
    commit (the fault-injection pause): the commit stands, recorded as the stop's checkpoint,
    though the processes could not confirm it together; the run still exits as stopped (143).
    Only the first and last steps are logged otherwise: the stop's own record of its loss, a
    collective, meets the dead rank and is given up."""
    run = tmp_path / "run"
    procs = xtrain_processes(run, "checkpoint.every=1000", "trainer.log_every=1000",
                             "trainer.collective_timeout_s=60", env={"XTRAIN_FAULT_SAVE_PAUSE": "4"})
    wait_for_step(run, 1, procs[0])
    for proc in procs:
        proc.send_signal(signal.SIGTERM)
    deadline = time.time() + 120
    while not list(run.glob("checkpoints/step_*/state.pt")):  # rank 0 is in the pause
        assert time.time() < deadline and procs[0].poll() is None, procs[0].communicate()[1][-3000:]
        time.sleep(0.05)
    procs[1].kill()
    code, out, err = finish_all(procs[:1], timeout=120)[0]
    procs[1].wait()
    assert code == 143, err[-3000:]
    stopped_at = stop_step(out)
    assert "checkpoint committed" in out
    assert [s for s, _ in committed_checkpoints(str(run / "checkpoints"))] == [stopped_at]
    records = read_jsonl(run / "metrics.jsonl")
    assert [r["step"] for r in records if r["kind"] == "checkpoint"] == [stopped_at]
    assert records[-1]["kind"] == "stop" and records[-1]["step"] == stopped_at


def wait_until_joined(port: int, rank: int, deadline: float, procs) -> None:
    """Until ``rank`` has joined the run: its heartbeat counter is in the rendezvous store
    (xtrain/engines/processes.py's Heartbeat)."""
    import torch.distributed as dist

    while True:
        assert time.time() < deadline and all(p.poll() is None for p in procs), procs[0].communicate()[1][-3000:]
        try:
            client = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False,
                                   timeout=timedelta(seconds=1))
            if dist.PrefixStore("xtrain-heartbeat", client).check([f"rank{rank}"]):
                return
        except (RuntimeError, dist.DistStoreError):  # rank 0 has not started the store yet
            pass
        time.sleep(0.01)


def test_a_rank_lost_before_training_starts_is_named(tmp_path):
    """Rank 1 frozen as soon as it has joined, then killed: rank 0 is then in a set-up collective
    (the shared-storage check, data preparation, the resume point), not in fit, and is told which
    process is gone (exit 3) as during training. Freezing it in time is a race the test can lose
    on a busy machine (rank 1 already training): such a round is played again, at most 3 times."""
    for attempt in range(3):
        run, port, timeout = tmp_path / f"run{attempt}", free_port(), 60
        procs = xtrain_processes(run, f"trainer.collective_timeout_s={timeout}", port=port)
        wait_until_joined(port, 1, time.time() + 120, procs)
        procs[1].send_signal(signal.SIGSTOP)  # its heartbeat stops with it
        time.sleep(1)
        procs[1].kill()
        code, _, err = finish_all(procs[:1], timeout=timeout + 30)[0]
        procs[1].wait()
        assert code == 3, err[-3000:]
        assert "xtrain: peer error: lost rank 1 of 2: no heartbeat" in err
        metrics = run / "metrics.jsonl"
        if not metrics.exists() or not any("loss" in r for r in read_jsonl(metrics)):
            return  # no step was trained: lost in set-up, and named
    pytest.fail("rank 1 was trained on before it could be frozen, 3 times: set-up was not covered")
