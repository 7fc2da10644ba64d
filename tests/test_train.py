"""CPU engine end to end: loss falls, metrics and checkpoints land in the run dir, resume works."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import TINY, checkpoint_tensors, read_jsonl, relative_differences
from xtrain.checkpoint.layout import committed_checkpoints
from xtrain.modes import run


def _train(compose_config, tmp_path, *extra):
    cfg = compose_config(TINY + list(extra), output_dir=str(tmp_path))
    return cfg, run(cfg, str(tmp_path))


def test_cpu_smoke_loss_falls_and_run_dir_is_complete(compose_config, tmp_path):
    cfg, summary = _train(compose_config, tmp_path, "trainer.max_steps=30")
    records = [r for r in read_jsonl(tmp_path / "metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in records] == [1, 5, 10, 15, 20, 25, 30]
    for r in records:
        assert {"step", "loss", "lr", "tokens", "tok_per_s"} <= set(r)
        assert r["tokens"] == r["step"] * 4 * 64
    assert records[-1]["loss"] < records[0]["loss"] - 1.5, records
    val = [r for r in read_jsonl(tmp_path / "metrics.jsonl") if "val_bpb" in r]
    assert val and 0 < val[-1]["val_bpb"] < 10
    # the last step is committed before its validation runs: one that fails loses no step
    last = [r["kind"] for r in read_jsonl(tmp_path / "metrics.jsonl") if r["step"] == 30]
    assert last.index("checkpoint") < last.index("val"), last
    assert summary["step"] == 30
    steps = [s for s, _ in committed_checkpoints(str(tmp_path / "checkpoints"))]
    assert steps == [30]
    meta = json.loads((tmp_path / "checkpoints" / "step_000030" / "meta.json").read_text())
    assert meta["config"]["model"]["depth"] == 2 and meta["torch"]


def test_rerun_resumes_and_grad_accumulation_is_derived(compose_config, tmp_path):
    extra = ["trainer.total_batch_size=512", "optim.warmdown_ratio=0"]  # 512 / (4 x 64) = 2 micro
    _train(compose_config, tmp_path, "trainer.max_steps=10", *extra)
    cfg, summary = _train(compose_config, tmp_path, "trainer.max_steps=15", *extra)
    assert summary["step"] == 15
    records = [r for r in read_jsonl(tmp_path / "metrics.jsonl") if "loss" in r]
    steps = [r["step"] for r in records]
    assert steps == [1, 5, 10, 11, 15]  # the second run started at step 10, not 0 (11: its first)
    assert records[-1]["tokens"] == 15 * 512


def test_batch_that_does_not_divide_is_refused_with_arithmetic(tmp_path):
    r = subprocess.run([sys.executable, "-m", "xtrain", "trainer.total_batch_size=3000",
                        f"hydra.run.dir={tmp_path}"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert "trainer.total_batch_size=3,000 is not a multiple of device_batch 8 x seq 256" in r.stderr
    assert not os.path.exists(tmp_path / "metrics.jsonl")


def _xtrain(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "xtrain", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "WANDB_MODE": "offline"})


SMALL = ["model=d2", "model.sequence_len=32", "trainer.device_batch_size=2", "trainer.sample_tokens=0",
         "trainer.eval_tokens=64", "trainer.log_every=1"]


def test_multirun_gives_one_dir_per_job_in_a_dir_per_sweep(tmp_path):
    def sweep(*args):
        r = subprocess.run([sys.executable, "-m", "xtrain", "-m", *SMALL, *args, "trainer.max_steps=2"],
                           cwd=tmp_path, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]

    sweep("optim.matrix_lr=0.01,0.02")
    sweep("optim.matrix_lr=0.03")  # another sweep: its own dir, the first's record kept
    first, second = sorted((tmp_path / "multirun").iterdir())  # named by their command lines
    assert first.name.startswith("d2-model.sequence_len_32-optim.matrix_lr_0.01,0.02-trainer.")
    assert second.name.startswith("d2-model.sequence_len_32-optim.matrix_lr_0.03-trainer.")
    assert "optim.matrix_lr=0.01,0.02" in (first / "multirun.yaml").read_text()
    assert "optim.matrix_lr=0.03" in (second / "multirun.yaml").read_text()
    jobs = sorted(p.name for p in first.iterdir() if p.is_dir())
    assert len(jobs) == 2 and all(j.startswith("d2-cpu-cpp_local-") for j in jobs)
    assert "optim.matrix_lr_0.01" in jobs[0] and "optim.matrix_lr_0.02" in jobs[1]
    for job in jobs:
        assert (first / job / "metrics.jsonl").exists()
        assert (first / job / ".hydra" / "config.yaml").exists()
    assert len([p for p in second.iterdir() if p.is_dir()]) == 1


def _plan_sweep(tmp_path, args, sweep: str) -> list[str]:
    """Run a sweep of plans whose sweep dir, named by the README's rule, is ``sweep``; returns the
    jobs' run dirs. That dir is made first, holding a file of the test's: a sweep that leaves no
    job dir (plans) keeps its record (multirun.yaml) only in a dir that holds more."""
    (tmp_path / "multirun" / sweep).mkdir(parents=True)
    (tmp_path / "multirun" / sweep / "kept").write_text("")
    r = subprocess.run([sys.executable, "-m", "xtrain", "-m", "mode=plan", *args], cwd=tmp_path,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    return [line.split(" -> ")[1] for line in r.stdout.splitlines() if line.startswith("run ")]


def test_sweeps_that_differ_only_in_keys_that_keep_a_runs_name_keep_apart(tmp_path):
    for steps in ("3,6", "10,20"):  # the jobs' names differ (in a sweep they carry every key)
        sweep = f"d2-mode_plan-trainer.max_steps_{steps}"
        jobs = _plan_sweep(tmp_path, ["model=d2", f"trainer.max_steps={steps}"], sweep)
        assert len(jobs) == 2 and {Path(job).parent for job in jobs} == {tmp_path / "multirun" / sweep}
    records = sorted((tmp_path / "multirun").glob("*/multirun.yaml"))
    assert [p.parent.name for p in records] == ["d2-mode_plan-trainer.max_steps_10,20",
                                                "d2-mode_plan-trainer.max_steps_3,6"]


@pytest.mark.parametrize("args, sweep", [
    (["+debug=fast,overfit"], "debug_fast,overfit-mode_plan"),
    (["model=d2", "optim.embedding_lr=${optim.matrix_lr}", "optim.matrix_lr=0.01,0.02"],
     "d2-mode_plan-optim.matrix_lr_0.01,0.02")], ids=["groups", "interpolation"])
def test_a_sweep_keeps_its_jobs_in_its_own_dir(tmp_path, args, sweep):
    """+debug=... sets model=d2 in every job, not in the sweep's own config, and an interpolation
    resolves to each job's value: the sweep dir must follow neither, or its record and its jobs
    part ways. Nor does a job's name show an interpolation (Hydra escapes it as $\\{...})."""
    jobs = _plan_sweep(tmp_path, args, sweep)
    (record,) = (tmp_path / "multirun").glob("*/multirun.yaml")
    assert len(jobs) == 2 and all(Path(job).parent == record.parent for job in jobs), (record, jobs)
    assert record.parent.name == sweep
    assert not [job for job in jobs if "$" in job]


# float32 rounds k micro-batch means summed differently from one mean over k x the rows; Adam's
# eps (1e-10) amplifies that in the few elements whose gradient nearly cancels, so elements are
# not compared one by one: every tensor's relative distance ||a - b|| / ||b|| is. Measured after
# 3 steps (d2, T 64): <= 8.1e-6 (k=2), <= 2.8e-5 (k=8); one micro-batch dropped per step: > 1e-2.
ACCUM_REL, ACCUM_LOSS_ATOL = 2e-4, 1e-5


@pytest.mark.parametrize("k", [2, 8])
def test_accumulating_k_micro_batches_updates_like_one_k_times_bigger_batch(compose_config, tmp_path, k):
    """Accumulation k with b rows per micro-batch and accumulation 1 with k x b rows see the same
    rows (the loader packs row by row) and must make the same updates: every parameter and
    optimizer-state tensor (the moments hold the gradients) after 3 steps, and every loss."""
    b, seq, steps = 2, 64, 3
    common = ["model=d2", f"model.sequence_len={seq}", f"trainer.max_steps={steps}", "trainer.log_every=1",
              "trainer.sample_tokens=0", "trainer.eval_tokens=128", "optim.warmup_steps=1"]
    runs = {"accumulated": [f"trainer.device_batch_size={b}", f"trainer.total_batch_size={k * b * seq}"],
            "one_batch": [f"trainer.device_batch_size={k * b}"]}
    records = {}
    for name, overrides in runs.items():
        out = tmp_path / name
        cfg = compose_config(common + overrides, output_dir=str(out))
        run(cfg, str(out))
        records[name] = [r for r in read_jsonl(out / "metrics.jsonl") if "loss" in r]
    assert [r["tokens"] for r in records["accumulated"]] == [s * k * b * seq for s in range(1, steps + 1)]
    assert [r["tokens"] for r in records["one_batch"]] == [r["tokens"] for r in records["accumulated"]]
    losses = [[r["loss"] for r in records[name]] for name in runs]
    assert max(abs(x - y) for x, y in zip(*losses)) <= ACCUM_LOSS_ATOL, losses
    final = [checkpoint_tensors(tmp_path / name / "checkpoints" / f"step_{steps:06d}") for name in runs]
    worst = max(relative_differences(*final).items(), key=lambda kv: kv[1])
    assert worst[1] <= ACCUM_REL, worst


def test_sweeping_a_name_neutral_key_still_gives_each_job_its_own_run(tmp_path):
    r = _xtrain("-m", *SMALL, "trainer.max_steps=3,6", f"hydra.sweep.dir={tmp_path}")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resuming" not in r.stdout
    jobs = sorted(p for p in tmp_path.iterdir() if p.is_dir())
    assert len(jobs) == 2
    last_steps = sorted(max(rec["step"] for rec in read_jsonl(job / "metrics.jsonl") if "loss" in rec)
                        for job in jobs)
    assert last_steps == [3, 6]


def test_a_run_with_many_long_overrides_gets_a_short_deterministic_name(tmp_path):
    overrides = [f"optim.{k}={v}" for k, v in (
        ("matrix_lr", 0.0123456789), ("embedding_lr", 0.1234567), ("unembedding_lr", 0.00412345),
        ("weight_decay", 0.0001234), ("adam_beta1", 0.8123456), ("adam_beta2", 0.9512345),
        ("muon_momentum", 0.9412345), ("grad_clip", 0.9876543), ("warmdown_ratio", 0.1234567),
        ("final_lr_frac", 0.0123456), ("warmup_steps", 1), ("adam_eps", 1.234e-9))]
    runs = tmp_path / "outputs"
    for _ in range(2):  # the same command twice: the same (shortened) name, so it resumes
        r = subprocess.run([sys.executable, "-m", "xtrain", *SMALL, "trainer.max_steps=2", *overrides],
                           cwd=tmp_path, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
    (run_dir,) = list(runs.iterdir())
    assert len(run_dir.name) <= 120 and run_dir.name.startswith("d2-cpu-cpp_local-model.sequence_len_32-optim.")
    assert "resuming from" in r.stdout
    assert "step_000002 is at this run's last step 2 (trainer.max_steps): nothing to train" in r.stdout
    kept = (run_dir / ".hydra" / "overrides.yaml").read_text()
    assert all(o.split("=")[0] in kept for o in overrides)  # the full list, unshortened
