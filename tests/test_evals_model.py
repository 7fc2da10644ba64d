"""The C++ benchmark judging a real model: during a CPU training run (``eval.cpp_every``) and
from its checkpoint (``mode=eval``). A two-problem file keeps it fast; the untrained model's
scores are whatever it earns, so the tests check where scores and records land, not their values."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import TINY, read_jsonl

ROOT = Path(__file__).resolve().parent.parent
PROBLEMS = [
    {"id": "add", "difficulty": "easy", "prompt": "int add(int a, int b) {\n",
     "reference": "  return a + b;\n}\n", "tests": "int main() { return add(2, 3) == 5 ? 0 : 1; }\n"},
    {"id": "neg", "difficulty": "hard", "prompt": "int neg(int a) {\n",
     "reference": "  return -a;\n}\n", "tests": "int main() { return neg(4) == -4 ? 0 : 1; }\n"},
]
EVAL = ["eval.max_tokens=12", "eval.n=2", "eval.temperature=0.8", "eval.k=[1,2]"]


def _xtrain(run_dir, *args):
    return subprocess.run([sys.executable, "-m", "xtrain", *TINY, *args, f"hydra.run.dir={run_dir}"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "WANDB_MODE": "offline"})


@pytest.fixture(scope="module")
def problem_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("bench") / "cpp.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in PROBLEMS))
    return path


@pytest.fixture(scope="module")
def evaluated_run(tmp_path_factory, problem_file):
    run_dir = tmp_path_factory.mktemp("run")
    r = _xtrain(run_dir, "trainer.max_steps=6", "eval.cpp_every=3", f"eval.cpp_file={problem_file}",
                *EVAL)
    assert r.returncode == 0, r.stderr[-3000:]
    return run_dir


def _check_records(path: Path, n: int):
    records = read_jsonl(path)
    assert sorted((r["id"], r["sample"]) for r in records) == \
        sorted((p["id"], i) for p in PROBLEMS for i in range(n))
    assert all(r["outcome"] in ("compile_error", "timeout", "runtime_error", "wrong_answer", "passed")
               for r in records)


def test_training_logs_cpp_scores_at_every_cpp_every_steps(evaluated_run):
    evals = [r for r in read_jsonl(evaluated_run / "metrics.jsonl") if r["kind"] == "eval"]
    assert [r["step"] for r in evals] == [3, 6]
    for r in evals:
        for key in ("cpp_compile_rate", "cpp_pass_rate", "cpp_pass@1", "cpp_pass@2",
                    "cpp_pass_rate/easy", "cpp_pass_rate/hard"):
            assert 0 <= r[key] <= 1, (key, r)
        assert r["cpp_eval_seconds"] > 0 and r["cpp_generate_tok_per_s"] > 0
    for step in (3, 6):
        _check_records(evaluated_run / "cpp_eval" / f"step_{step:06d}.jsonl", n=2)


def test_training_goes_on_while_an_evaluation_runs(tmp_path, problem_file):
    """The evaluation runs in the background: the step after it started is logged before its
    record (eight compiles and tests per problem make the evaluation slow next to a d2 step); the one still running when the run ends (step 6 of 7) is waited for."""
    r = _xtrain(tmp_path, "trainer.max_steps=7", "trainer.log_every=1", "eval.cpp_every=3",
                f"eval.cpp_file={problem_file}", *EVAL, "eval.n=8")
    assert r.returncode == 0, r.stderr[-3000:]
    records = read_jsonl(tmp_path / "metrics.jsonl")
    order = [(r["kind"], r["step"]) for r in records if r["kind"] in ("train", "eval")]
    evals = {r["step"]: r for r in records if r["kind"] == "eval"}
    train = {r["step"]: r for r in records if r["kind"] == "train"}
    assert sorted(evals) == [3, 6]
    assert order.index(("train", 4)) < order.index(("eval", 3))
    assert train[4]["time"] < evals[3]["time"]  # logged while the evaluation still ran
    assert order[-1] == ("eval", 6)  # written at the end, after step 7
    for step in (3, 6):
        _check_records(tmp_path / "cpp_eval" / f"step_{step:06d}.jsonl", n=8)


def test_an_evaluation_that_fails_is_a_warning_and_training_goes_on(tmp_path, problem_file):
    """An evaluation's own failure (here its records cannot be written: a file stands where their
    dir goes) does not end the run: a warning, no eval record, every step trained."""
    (tmp_path / "cpp_eval").write_text("not a dir")
    r = _xtrain(tmp_path, "trainer.max_steps=4", "eval.cpp_every=2", f"eval.cpp_file={problem_file}",
                *EVAL)
    assert r.returncode == 0, r.stderr[-3000:]
    for step in (2, 4):
        assert f"C++ evaluation of step {step} failed, training goes on: " in r.stdout + r.stderr
    records = read_jsonl(tmp_path / "metrics.jsonl")
    assert not [r for r in records if r["kind"] == "eval"]
    assert max(r["step"] for r in records if r["kind"] == "train") == 4


@pytest.mark.parametrize("training", ["running", "waiting"])
def test_a_stop_does_not_wait_for_a_running_evaluation(tmp_path, problem_file, training):
    """SIGTERM while step 3's evaluation (made long: 16 samples of 400 tokens at 512 context)
    still runs, with training going on (step 5) or waiting for it (at step 6, where the next
    evaluation is due): the run checkpoints and exits at once, abandoning it, instead of holding
    a preemption's last seconds (and every further signal) until it ends. The same command
    again judges each evaluation the stop called off from its step's checkpoint, in the
    background, each step's once; one whose checkpoint cannot be read fails alone."""
    import signal
    import time

    from conftest import finish, xtrain
    from test_checkpoint import wait_for_step

    run = tmp_path / "run"
    args = ["model.sequence_len=512", "eval.cpp_every=3", "checkpoint.every=3",
            "checkpoint.keep_every=3", f"eval.cpp_file={problem_file}", "eval.temperature=0.8",
            "eval.k=[1]"]
    proc = xtrain(run, *args, "trainer.max_steps=50", "eval.n=16", "eval.max_tokens=400")
    wait_for_step(run, 5 if training == "running" else 6, proc)
    if training == "waiting":
        time.sleep(1.0)  # step 6's hook is waiting for step 3's evaluation
    proc.send_signal(signal.SIGTERM)
    code, out, err = finish(proc)
    assert code == 143, err[-3000:]
    assert "C++ evaluation of step 3 abandoned: the run stopped before it finished" in err
    records = read_jsonl(run / "metrics.jsonl")
    assert not [r for r in records if r["kind"] == "eval"]  # not waited for
    assert "checkpoint committed" in out
    stopped_at = max(r["step"] for r in records if r["kind"] == "train")
    assert stopped_at < 12, stopped_at
    judged = [3, 6, 9, 12]
    if training == "running":  # step 3's checkpoint damaged since: that evaluation alone fails
        for data in (run / "checkpoints" / "step_000003" / "tensors").glob("*.distcp"):
            data.unlink()
        judged.remove(3)
    code, out, err = finish(xtrain(run, *args, "trainer.max_steps=12", "eval.n=1", "eval.max_tokens=8"))
    assert code == 0, err[-3000:]
    assert ("C++ evaluation of step 3 failed, training goes on" in err) == (training == "running")
    evals = [r["step"] for r in read_jsonl(run / "metrics.jsonl") if r["kind"] == "eval"]
    assert sorted(evals) == judged, evals
    for step in evals:
        _check_records(run / "cpp_eval" / f"step_{step:06d}.jsonl", n=1)


@pytest.mark.parametrize("stop_by", ["signal", "notice"])
def test_a_stop_after_the_last_step_ends_as_a_stop_and_the_same_command_finishes_it(
        tmp_path, problem_file, request, stop_by):
    """SIGTERM, or a GCE notice (from tests/test_notices.py's stand-in metadata server), while
    the end's evaluation (step 6 of 6, made long) runs, the last checkpoint committed and
    validated: the run ended with exit 0 and no eval record, finished to anyone watching (a
    launcher never ran it again); a notice was not even watched after training. Now it ends as
    stopped (exit 143, a stop record); the same command records the evaluation its end lacks."""
    import signal
    import time

    from conftest import finish, xtrain

    run = tmp_path / "run"
    args = ["trainer.max_steps=6", "model.sequence_len=512", "eval.cpp_every=6",
            f"eval.cpp_file={problem_file}", "eval.temperature=0.8", "eval.k=[1]"]
    if stop_by == "notice":
        from test_notices import MetadataServer

        server = MetadataServer()
        request.addfinalizer(server.close)
        args.append(f"preemption.metadata_url={server.url}")
    proc = xtrain(run, *args, "eval.n=16", "eval.max_tokens=400")
    deadline = time.time() + 240
    while not any(r["kind"] == "val" and r["step"] == 6 for r in (
            read_jsonl(run / "metrics.jsonl") if (run / "metrics.jsonl").exists() else [])):
        assert proc.poll() is None and time.time() < deadline, proc.communicate()[1][-3000:]
        time.sleep(0.05)
    time.sleep(0.5)  # in the end's wait for the evaluation
    if stop_by == "notice":
        server.announce("preempted", "TRUE")
        reason = "GCE notice instance/preempted=TRUE"
    else:
        proc.send_signal(signal.SIGTERM)
        reason = "SIGTERM"
    code, out, err = finish(proc)
    assert code == 143, err[-3000:]
    if stop_by == "signal":
        assert "SIGTERM: training reached its last step; stopping what the run's end still does" in err
    assert "C++ evaluation of step 6 abandoned: the run stopped before it finished" in err
    assert f"stopped ({reason}) at step 6: checkpoint committed" in out
    records = read_jsonl(run / "metrics.jsonl")
    assert [(r["step"], r["stopped_for"]) for r in records if r["kind"] == "stop"] == [(6, stop_by)]
    assert not [r for r in records if r["kind"] == "eval"]
    if stop_by == "notice":
        server.announce("preempted", "FALSE")  # (the VM the run resumes on)
    code, out, err = finish(xtrain(run, *args, "eval.n=1", "eval.max_tokens=8"))
    assert code == 0, err[-3000:]
    assert [r["step"] for r in read_jsonl(run / "metrics.jsonl") if r["kind"] == "eval"] == [6]


def test_mode_eval_prints_the_scores_of_the_runs_checkpoint(evaluated_run, problem_file):
    r = _xtrain(evaluated_run, "mode=eval", f"eval.cpp_file={problem_file}", "eval.max_tokens=8")
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"evaluating {evaluated_run}/checkpoints/step_000006 on 2 C++ problems x 1 samples" \
        in r.stdout
    assert "C++ scores at step 6:" in r.stdout and "  cpp_pass_rate: " in r.stdout
    (records,) = (evaluated_run / "cpp_eval").glob("step_000006-eval-*.jsonl")
    _check_records(records, n=1)
    # beside training's records of step 6, which its eval record in metrics.jsonl scored
    _check_records(evaluated_run / "cpp_eval" / "step_000006.jsonl", n=2)


def test_evaluations_of_one_step_started_in_one_second_keep_their_records_apart():
    """mode=eval's records were named to the second: two evaluations of a step started within
    one (two commands, or a sweep's jobs) wrote one file."""
    from xtrain.evals.completions import records_path

    paths = [records_path("gs://b/run", 6, later=True) for _ in range(20)]  # (within a second)
    assert len(set(paths)) == 20 and records_path("gs://b/run", 6) not in paths
    assert all(p.startswith("gs://b/run/cpp_eval/step_000006-eval-") and p.endswith(".jsonl") for p in paths)


def test_mode_eval_refuses_a_missing_checkpoint(tmp_path):
    r = _xtrain(tmp_path, "mode=eval")
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1] == (
        f"xtrain: input error: mode=eval: no committed checkpoint in {tmp_path}/checkpoints "
        "(train this run first, or set checkpoint.resume=PATH)")


def test_mode_eval_refuses_a_malformed_problem_file_naming_the_line(evaluated_run, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(PROBLEMS[0]) + "\n" + '{"id": "x"\n')
    r = _xtrain(evaluated_run, "mode=eval", f"eval.cpp_file={bad}")
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1].startswith(f"xtrain: config error: {bad}:2: bad JSON")
    assert "evaluating" not in r.stdout


def test_the_snapshot_is_a_copy_training_cannot_change():
    """The CPU engine's snapshot: equal outputs, its own tensors (rotary tables included), no
    compiled forward carried over (trainer.compile's wrapper is an instance attribute), and the
    global RNG untouched (no random initialisation of the copy)."""
    import torch

    from conftest import compose_cfg
    from xtrain.engines.torch_compile import loss_compiled
    from xtrain.model.config import GPTConfig
    from xtrain.model.gpt import GPT
    from xtrain.plan import resolve
    from xtrain.train.cpp_eval import cpu_snapshot

    cfg = compose_cfg(["model=d2", "model.sequence_len=64"])
    resolve(cfg, 1)
    model = GPT(GPTConfig.from_model(cfg.model))
    model.forward = loss_compiled(model.forward, lambda f: f)
    rng = torch.random.get_rng_state()
    snapshot = cpu_snapshot(model)
    assert torch.equal(rng, torch.random.get_rng_state())
    assert "forward" not in vars(snapshot)
    idx = torch.randint(0, model.config.vocab_size, (1, 8))
    assert torch.equal(model(idx), snapshot(idx))
    live = dict(model.state_dict(), **dict(model.named_buffers()))
    copy = dict(snapshot.state_dict(), **dict(snapshot.named_buffers()))
    assert live.keys() == copy.keys() and "cos" in copy
    assert all(live[k].data_ptr() != copy[k].data_ptr() for k in live)
    with torch.no_grad():
        model.wte.weight.add_(1.0)
    assert not torch.equal(model(idx), snapshot(idx))


def test_an_evaluation_whose_checkpoint_a_later_one_passed_over_gives_up_at_once(tmp_path):
    """On several processes the evaluation reads its step's checkpoint once committed. One that
    never will be (retention removed it before it was read, or its upload gave up) was waited
    for an hour (COMMIT_WAIT_S), and the end of the run with it: a later committed step ends the
    wait."""
    import threading
    import time

    import torch

    from xtrain.checkpoint.async_io import FsspecCheckpointIO
    from xtrain.train.cpp_eval import committed_weights

    io = FsspecCheckpointIO(retries=0)
    io.save_checkpoint({"state_dict": {"model.w": torch.zeros(2)}, "global_step": 10},
                       str(tmp_path / "step_000010"))
    assert io.wait() is not None
    t0 = time.monotonic()
    assert committed_weights(None, str(tmp_path / "step_000005"), threading.Event()) is None
    assert time.monotonic() - t0 < 10
