"""The report over a 3-job sweep (plots and summary), the reproducibility bundle, secrets masked,
and a run whose run dir is a gs:// URL (GCS emulator)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import TINY, gcs_filesystem, read_jsonl
from logreaders import wandb_runs

ROOT = Path(__file__).resolve().parent.parent
LRS = ("0.01", "0.02", "0.04")


def is_png(path: Path) -> bool:
    import matplotlib.image

    return path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and matplotlib.image.imread(path).ndim == 3


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    """A real 3-job sweep (-m), every job logging to W&B offline too."""
    out = tmp_path_factory.mktemp("sweep")
    r = subprocess.run([sys.executable, "-m", "xtrain", "-m", *TINY, f"optim.matrix_lr={','.join(LRS)}",
                        "trainer.max_steps=10", "trainer.eval_every=5", "logger=[jsonl,wandb]",
                        f"hydra.sweep.dir={out}"], cwd=ROOT, capture_output=True, text=True,
                       timeout=900, env={**os.environ, "WANDB_MODE": "offline"})
    assert r.returncode == 0, r.stderr[-3000:]
    return out


def report(*args):
    return subprocess.run([sys.executable, "-m", "xtrain.report", *map(str, args)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def test_report_draws_a_sweep_together_with_a_summary_table(sweep, tmp_path):
    r = report(sweep, "--out", tmp_path / "report")
    assert r.returncode == 0, r.stderr
    jobs = sorted(p.name for p in sweep.iterdir() if p.is_dir())
    assert len(jobs) == 3
    rows = (tmp_path / "report" / "summary.md").read_text().splitlines()[2:]
    assert [row.split(" | ")[0].lstrip("| ") for row in rows] == jobs
    differs = []
    for row, job in zip(rows, jobs):
        cells = row.strip("| ").split(" | ")
        last = [x for x in read_jsonl(sweep / job / "metrics.jsonl") if x["kind"] == "train"][-1]
        val = [x for x in read_jsonl(sweep / job / "metrics.jsonl") if x["kind"] == "val"][-1]
        assert cells[2] == "10" and float(cells[3]) == pytest.approx(last["loss"], abs=1e-4)
        assert float(cells[4]) == pytest.approx(val["val_bpb"], abs=1e-4)
        differs.append(cells[1])
    # what tells the jobs apart: the swept value as given (their names end in a hash: too long)
    assert sorted(differs) == [f"optim.matrix_lr={lr}" for lr in LRS]
    assert rows[0] in r.stdout
    for metric in ("loss", "val_loss", "val_bpb", "tok_per_s", "mfu"):
        assert is_png(tmp_path / "report" / f"{metric}.png"), metric
    # a sweep's jobs share one W&B group, each its own run
    runs = [wandb_runs(sweep / job)[0] for job in jobs]
    assert len({r["id"] for r in runs}) == 3
    (group,) = {r["group"] for r in runs}  # the sweep's command line, shortened (over 120)
    assert group.startswith(f"d2-logger__jsonl,wandb_-model.sequence_len_64-optim.matrix_lr_"
                            f"{','.join(LRS)}-trainer.device_batch_size_4-") and len(group) <= 120


def test_report_takes_single_runs_and_chosen_metrics(sweep, tmp_path):
    jobs = sorted(p for p in sweep.iterdir() if p.is_dir())
    r = report(jobs[0], jobs[2], "--out", tmp_path, "--metrics", "grad_norm,lr")
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in tmp_path.glob("*.png")) == ["grad_norm.png", "lr.png"]
    assert len((tmp_path / "summary.csv").read_text().splitlines()) == 3  # header + 2 runs


def test_report_names_a_run_given_as_dot_by_its_dir_and_counts_it_once(sweep, tmp_path):
    job = sorted(p for p in sweep.iterdir() if p.is_dir())[0]
    r = subprocess.run([sys.executable, "-m", "xtrain.report", ".", str(job), "--out", str(tmp_path)],
                       cwd=job, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    rows = (tmp_path / "summary.md").read_text().splitlines()[2:]
    assert [row.split(" | ")[0].lstrip("| ") for row in rows] == [job.name]


@pytest.mark.parametrize("other_sweep", ["another-sweep", "{sweep}"], ids=["same job", "same sweep"])
def test_report_keeps_runs_of_one_name_apart(sweep, tmp_path, other_sweep):
    """The same job in two sweeps, or the same sweep in two places (another checkout, a bucket)."""
    import shutil

    job = sorted(p for p in sweep.iterdir() if p.is_dir())[0]
    other = tmp_path / "elsewhere" / other_sweep.format(sweep=sweep.name)
    shutil.copytree(job, other / job.name)
    records = (other / job.name / "metrics.jsonl").read_text().splitlines()
    (other / job.name / "metrics.jsonl").write_text("\n".join(records[:3]) + "\n")  # a shorter run
    r = report(sweep, other, "--out", tmp_path / "report")
    assert r.returncode == 0, r.stderr
    rows = [row.strip("| ").split(" | ") for row in
            (tmp_path / "report" / "summary.md").read_text().splitlines()[2:]]
    assert len(rows) == 4 and len({row[0] for row in rows}) == 4
    steps = [row[2] for row in rows if row[0].endswith(job.name)]  # both runs, the shorter one too
    assert len(steps) == 2 and "10" in steps and len(set(steps)) == 2


def test_report_takes_a_dir_of_sweeps_and_names_a_job_that_left_no_records(sweep, tmp_path):
    """``multirun/`` holds sweeps (and here a run of its own); a job that failed before its first
    step has a dir but no metrics.jsonl: the report says it left it out, rather than drawing the
    others silently. A dir that is no job (an earlier report) is no such warning."""
    import shutil

    runs = tmp_path / "multirun"
    shutil.copytree(sweep, runs / sweep.name)
    shutil.copytree(sorted(p for p in sweep.iterdir() if p.is_dir())[0], runs / "stray")
    crashed = runs / sweep.name / "d2-crashed"
    (crashed / ".hydra").mkdir(parents=True)
    (crashed / "console.log").write_text("Traceback ...\n")
    (runs / sweep.name / "report").mkdir()
    r = report(runs, runs, "--out", runs / sweep.name / "report")
    assert r.returncode == 0, r.stderr
    rows = (runs / sweep.name / "report" / "summary.md").read_text().splitlines()[2:]
    assert sorted(row.split(" | ")[0].lstrip("| ") for row in rows)[-1] == "stray" and len(rows) == 4
    assert r.stderr == (f"xtrain.report: warning: {crashed}: no metrics.jsonl (yet: a job still "
                        "starting, or one that ended before its first step): left out\n"), r.stderr


def test_report_finds_the_jobs_a_sweeps_subdir_nests_in_a_dir_of_sweeps(sweep, tmp_path):
    """hydra.sweep.subdir=lr/${optim.matrix_lr} puts a sweep's jobs two dirs below its own:
    given the dir of sweeps, the report did not look that deep, and found no run."""
    import shutil

    runs = tmp_path / "multirun"
    (runs / sweep.name).mkdir(parents=True)
    shutil.copy(sweep / "multirun.yaml", runs / sweep.name)
    jobs = sorted(p.name for p in sweep.iterdir() if p.is_dir())
    for job in jobs:
        shutil.copytree(sweep / job, runs / sweep.name / "lr" / job)
    r = report(runs, "--out", tmp_path / "report")
    assert r.returncode == 0 and r.stderr == "", r.stderr
    rows = (tmp_path / "report" / "summary.md").read_text().splitlines()[2:]
    assert [row.split(" | ")[0].lstrip("| ") for row in rows] == jobs


def test_the_summary_takes_the_last_loss_and_bpb_and_the_median_rate_past_the_first_step():
    """Figures worked out by hand: the loss and bpb rise at the end (last is not lowest), and
    step 1's rate (it compiles) stays out of the median."""
    from xtrain.report import summary_row

    records = [{"kind": "train", "step": 1, "loss": 5.0, "tok_per_s": 10.0},
               {"kind": "train", "step": 2, "loss": 4.0, "tok_per_s": 300.0},
               {"kind": "val", "step": 2, "val_bpb": 1.5},
               {"kind": "train", "step": 3, "loss": 3.0, "tok_per_s": 100.0},
               {"kind": "train", "step": 4, "loss": 3.5, "tok_per_s": 200.0},
               {"kind": "val", "step": 4, "val_bpb": 1.75}]
    assert summary_row("r", None, records, []) == {
        "run": "r", "differs in": "", "steps": 4, "final loss": 3.5, "final val bpb": 1.75,
        "tok/s (median)": 200.0}


def test_the_summary_and_the_eval_chart_take_scores_not_timings():
    """An eval record also holds seconds and tokens/s: "best" of those would be the slowest."""
    from xtrain.evals.harness import score
    from xtrain.observe.plots import eval_metrics
    from xtrain.report import summary_row

    samples = [{"id": "a", "difficulty": "easy", "compiled": True, "outcome": "passed"},
               {"id": "a", "difficulty": "easy", "compiled": False, "outcome": "compile_error"}]
    scores = score(samples, [1])
    # the best score neither first nor last, so "best" cannot be either of those
    records = [{"kind": "eval", "step": 10, **{k: v / 2 for k, v in scores.items()},
                "cpp_eval_seconds": 9.0},
               {"kind": "eval", "step": 20, **scores, "cpp_eval_seconds": 8.0},
               {"kind": "eval", "step": 30, **{k: v / 4 for k, v in scores.items()},
                "cpp_eval_seconds": 1.0, "cpp_generate_tok_per_s": 50.0}]
    assert eval_metrics(records) == sorted(scores)  # every score, nothing else
    row = summary_row("run", None, records, eval_metrics(records))
    assert row["best cpp_pass_rate"] == scores["cpp_pass_rate"] == 0.5
    assert not [k for k in row if "seconds" in k or "tok_per_s" in k]


def test_records_follow_the_last_attempt_and_a_torn_line_is_skipped(tmp_path, caplog):
    """A run killed at step 16 (its last checkpoint at 10) resumed and logged steps 12 and 14
    again: the killed attempt's records from step 12 on are gone, those before stay, and so do
    its interruption records; the resumed run's line cut short by a VM's stop is skipped. (A
    start logs its first step whatever its log_every: tests/test_observe.py.)"""
    from xtrain.observe.plots import read_records

    lines = [{"step": 10, "kind": "train", "loss": 3.0}, {"step": 10, "kind": "val", "val_bpb": 2.0},
             {"step": 12, "kind": "train", "loss": 2.9}, {"step": 14, "kind": "train", "loss": 2.8},
             {"step": 14, "kind": "val", "val_bpb": 1.9}, {"step": 16, "kind": "train", "loss": 2.7},
             {"step": 16, "kind": "stop", "stopped_for": "signal"},
             {"step": 10, "kind": "preemption", "preemptions": 1},
             {"step": 12, "kind": "train", "loss": 2.95}, {"step": 14, "kind": "train", "loss": 2.85}]
    text = "\n".join(json.dumps(x) for x in lines) + '\n{"step": 16, "kind": "tra\n'
    # and a line of bytes that are not UTF-8 (a disk's damage): skipped too, not a traceback
    (tmp_path / "metrics.jsonl").write_bytes(text.encode() + b'\xff\xfe{"step": 18}\n')
    with caplog.at_level("WARNING"):
        records = read_records(str(tmp_path))
    assert [(r["kind"], r["step"]) for r in records] == [
        ("train", 10), ("val", 10), ("preemption", 10), ("train", 12), ("train", 14), ("stop", 16)]
    assert [r["loss"] for r in records if r["kind"] == "train"] == [3.0, 2.95, 2.85]
    assert "metrics.jsonl: skipped 2 line(s) that are not JSON records" in caplog.text


def test_a_chart_is_replaced_whole_and_a_run_without_records_draws_none(tmp_path):
    """A chart or table rewritten in place was emptied first: a write that failed (a full disk, a
    signal) left an empty file where the last good chart was. A run stopped before its first
    record has nothing to draw, and says nothing about it (it once warned of a missing file)."""
    from xtrain.observe.plots import write_run_plots
    from xtrain.paths import write_whole

    chart = tmp_path / "plots" / "loss.png"
    write_whole(str(chart), b"the good chart")
    with pytest.raises(TypeError):
        write_whole(str(chart), "not bytes")  # fails inside the write
    assert chart.read_bytes() == b"the good chart"
    assert sorted(p.name for p in chart.parent.iterdir()) == ["loss.png"]  # nothing left aside
    assert write_run_plots(str(tmp_path / "stopped_at_once")) == []


def test_report_refuses_an_unknown_metric_and_a_dir_without_runs(sweep, tmp_path):
    r = report(sweep, "--out", tmp_path / "a", "--metrics", "loss,val_bpp")
    assert r.returncode == 2
    assert r.stderr.startswith("xtrain.report: unknown metric 'val_bpp': the runs have ")
    assert "val_bpb" in r.stderr and not (tmp_path / "a").exists()
    r = report(tmp_path, "--out", tmp_path / "b")
    assert r.returncode == 2
    assert f"{tmp_path}: no metrics.jsonl in it, in its subdirectories or theirs" in r.stderr
    (tmp_path / "file").write_text("kept")  # --out naming a file: one line, the file untouched
    r = report(sweep, "--out", tmp_path / "file")
    assert r.returncode == 2 and r.stderr.startswith(
        f"xtrain.report: --out {tmp_path}/file: cannot be made a directory (FileExistsError: "), r.stderr
    assert (tmp_path / "file").read_text() == "kept"
    for args in (["htps://bucket/sweep", "--out", tmp_path / "c"], [sweep, "--out", "foo://charts"]):
        r = report(*args)  # (no such protocols)
        assert r.returncode == 2 and r.stderr.startswith("xtrain.report: ") and "Traceback" not in r.stderr, r.stderr
        assert "cannot be opened (ValueError: Protocol not known: " in r.stderr, r.stderr


def test_every_run_leaves_its_plots_and_reproducibility_bundle(sweep):
    import yaml

    job = sorted(p for p in sweep.iterdir() if p.is_dir())[0]
    for name in ("loss.png", "val_bpb.png", "throughput.png"):
        assert is_png(job / "plots" / name)
    bundle = job / "repro" / "step_000000"
    config = yaml.safe_load((bundle / "config.yaml").read_text())
    assert config["model"]["depth"] == 2 and config["optim"]["matrix_lr"] == 0.01
    code = json.loads((bundle / "code.json").read_text())
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True,
                          text=True).stdout.strip()
    assert code["git"] is True and code["commit"] == head
    packages = (bundle / "packages.txt").read_text().splitlines()
    from importlib.metadata import version

    assert f"torch=={version('torch')}" in packages and f"lightning=={version('lightning')}" in packages
    devices = json.loads((bundle / "devices.json").read_text())
    assert devices["engine"] == "cpu" and devices["mesh"] == {"data": 1, "fsdp": 1, "tensor": 1}
    assert devices["devices"][0]["type"] == "cpu"
    assert json.loads((bundle / "env.json").read_text())["WANDB_MODE"] == "offline"


def test_code_state_records_the_diff_or_the_installed_version(tmp_path):
    from xtrain.observe.bundle import code_state

    repo = tmp_path / "repo"
    (repo / "pkg").mkdir(parents=True)
    (repo / "pkg" / "mod.py").write_text("x = 1\n")
    git = lambda *a: subprocess.run(["git", "-C", str(repo), *a], check=True, capture_output=True,  # noqa: E731
                                    text=True, env={**os.environ, "GIT_AUTHOR_NAME": "t",
                                                    "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
                                                    "GIT_COMMITTER_EMAIL": "t@t"}).stdout
    git("init", "-q")
    git("add", ".")
    git("commit", "-qm", "first")
    (repo / "pkg" / "mod.py").write_text("x = 2\n")
    (repo / "pkg" / "new.py").write_text("")
    facts, diff = code_state(repo / "pkg")
    assert facts["commit"] == git("rev-parse", "HEAD").strip() and facts["dirty"]
    assert facts["changed"] == ["pkg/mod.py"] and facts["untracked"] == ["pkg/new.py"]
    assert "-x = 1\n+x = 2" in diff
    facts, diff = code_state(tmp_path / "elsewhere")  # not a git tree: the installed version
    assert facts["git"] is False and "installed_version" in facts and diff == ""


def test_secrets_a_launcher_forwarded_are_masked_whatever_their_names(tmp_path):
    """hydra.launcher.secrets may name any variable (HF_LOGIN says nothing of a secret): the launcher
    sends the list of names with the values, and the job masks each of them."""
    from xtrain.launcher import secrets
    from xtrain.config.secrets import SECRET_NAMES_VAR
    from xtrain.observe.bundle import mask_secrets, relevant_env

    env = {"HF_LOGIN": "hf_patvalue0123", "GOOGLE_SA_JSON": '{"private_key": "pk0123456789"}'}
    with pytest.MonkeyPatch.context() as mp:
        for name in secrets.ALWAYS:
            mp.delenv(name, raising=False)
        mp.setenv("HOME", str(tmp_path))  # no key of `wandb login` in ~/.netrc (it would go too)
        for name, value in env.items():
            mp.setenv(name, value)
        sent = secrets.collect(["HF_LOGIN", "GOOGLE_SA_JSON"])
    assert sent[SECRET_NAMES_VAR].split(",") == ["HF_LOGIN", "GOOGLE_SA_JSON"]
    job_env = {**sent, "XLA_FLAGS": "--x"}
    assert relevant_env(job_env) == {"GOOGLE_SA_JSON": "***", "HF_LOGIN": "***",
                                     SECRET_NAMES_VAR: "***", "XLA_FLAGS": "--x"}  # its name says secret
    assert mask_secrets({"run": {"name": "x-hf_patvalue0123"}}, job_env) == {"run": {"name": "x-***"}}
    assert relevant_env(env) == env  # not forwarded: nothing says they are secrets


def test_secrets_are_masked_by_name_and_by_value():
    from xtrain.observe.bundle import mask_secrets, relevant_env

    env = {"WANDB_API_KEY": "k" * 40, "HF_TOKEN": "hf_secretvalue", "XLA_FLAGS": "--x",
           "HOME": "/root", "PJRT_DEVICE": "CPU"}
    config = {"data": {"tokenizer": "/cache/tok", "train_files": "gs://b/" + "k" * 40},
              "notes": ["uses hf_secretvalue"], "api_key": "plain", "checkpoint": {"keep_last": 2}}
    masked = mask_secrets(config, env)
    assert masked == {"data": {"tokenizer": "/cache/tok", "train_files": "gs://b/***"},
                      "notes": ["uses ***"], "api_key": "***", "checkpoint": {"keep_last": 2}}
    assert relevant_env(env) == {"HF_TOKEN": "***", "PJRT_DEVICE": "CPU", "WANDB_API_KEY": "***",
                                 "XLA_FLAGS": "--x"}
    # code.diff: literals set under secret names, with no such variable in this environment
    diff = ("+export WANDB_API_KEY=" + "0f1e2d3c" * 5 + "\n-  api_key: '" + "9a8b" * 5 + "'  # prod\n"
            " token = tokenizer.encode(text)\n+GOOGLE_APPLICATION_CREDENTIALS=/etc/sa-key-0123.json\n")
    assert mask_secrets(diff, {}) == (
        "+export WANDB_API_KEY=***\n-  api_key: '***'  # prod\n token = tokenizer.encode(text)\n"
        "+GOOGLE_APPLICATION_CREDENTIALS=/etc/sa-key-0123.json\n")


def test_values_of_a_secrets_form_are_masked_whatever_their_keys():
    """A private index's token in a URL, and access keys of fixed formats (made up here), under
    keys and in environments that say nothing of secrets; look-alikes stay."""
    from xtrain.config.secrets import SECRET_WORDS
    from xtrain.observe.bundle import mask_secrets

    github, hf = "ghp_" + "A1b2" * 9, "hf_" + "Xy9" * 11
    config = {"pip_args": ["--index-url=https://ci:" + "s3cr3tT0k@pypi.example.com/simple",  # in pieces: synced
                           "--extra-index-url=https://" + "1a2B3c4D5e6F7g8H9i0J@pypi.fury.io/alice/"],
              "env": {"GH_LOGIN": github, "NOTE": f"made with {hf}"}, "aws": "AKIA" + "Q7" * 8,
              "keep": ["https://pypi.org/simple", "gs://bucket/runs", "git@github.com:o/r.git",
                       "hf_hub", "ghp_short", "sk-learn", "step_000020",
                       "ssh://git@github.com/o/r.git", "https://alice2024@example.com/x",
                       "postgres://analytics_reader_01@db/x", "https://analytics_reader_01@x"]}
    assert mask_secrets(config, environ={}) == {
        "pip_args": ["--index-url=https://***@pypi.example.com/simple",
                     "--extra-index-url=https://***@pypi.fury.io/alice/"],
        "env": {"GH_LOGIN": "***", "NOTE": "made with ***"}, "aws": "***", "keep": config["keep"]}
    assert "pat" in SECRET_WORDS and mask_secrets({"GH_PAT": "x"}, environ={}) == {"GH_PAT": "***"}


def test_a_gs_run_dir_gets_metrics_console_log_bundle_and_plots(gcs_bucket, compose_config, tmp_path,
                                                                 monkeypatch):
    """metrics.jsonl, console.log, the bundle and the plots go through fsspec to the bucket; the
    working dir gets nothing (the URL is no local path)."""
    from xtrain.modes import run

    bucket, _ = gcs_bucket
    run_dir = f"{bucket}/runs/tiny"
    cfg = compose_config(TINY + ["trainer.max_steps=6", "logger=[jsonl,tensorboard]"], output_dir=run_dir)
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    run(cfg, run_dir)
    assert list(cwd.iterdir()) == []
    fs = gcs_filesystem(bucket)
    root = run_dir.removeprefix("gs://")
    records = [json.loads(x) for x in fs.cat_file(f"{root}/metrics.jsonl").decode().splitlines()]
    assert [r["step"] for r in records if r["kind"] == "train"] == [1, 5, 6]
    assert "step      6/6" in fs.cat_file(f"{root}/console.log").decode()
    assert fs.exists(f"{root}/repro/step_000000/config.yaml") and fs.exists(f"{root}/plots/loss.png")
    assert fs.exists(f"{root}/checkpoints/step_000006/COMMITTED")
    # TensorBoard writes local files only: a mirror under the cache root
    mirror = Path(os.environ["XTRAIN_CACHE"], "runs", "gs_xtrain-test_runs_tiny", "tensorboard")
    assert list(mirror.glob("events.out.tfevents.*"))
    # the report finds it under the bucket's runs/ (listed through fsspec), and draws it
    from xtrain.report import report

    (row,) = report([f"{bucket}/runs"], str(tmp_path / "report"))
    assert (row["run"], row["steps"], row["differs in"]) == ("tiny", 6, "")
    assert is_png(tmp_path / "report" / "loss.png")
