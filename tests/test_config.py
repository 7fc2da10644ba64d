"""Every group option composes, against its schema; bad input fails fast with the field's name."""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from xtrain.cli import config_dir
from xtrain.errors import EXIT_REFUSED

CONF = Path(config_dir())


def options(group: str) -> list[str]:
    """Selectable options; files starting with _ are shared bases (`defaults: [_base]`)."""
    return sorted(p.stem for p in (CONF / group).glob("*.yaml") if not p.stem.startswith("_"))


@pytest.mark.parametrize("group", ["hardware", "model", "data", "parallelism", "optim"])
def test_every_option_composes_and_matches_its_yaml(group, compose_config):
    import yaml

    assert options(group), f"conf/{group} is empty"
    for option in options(group):
        cfg = compose_config([f"{group}={option}"])
        declared = yaml.safe_load((CONF / group / f"{option}.yaml").read_text()) or {}
        for key, value in declared.items():
            if key == "defaults" or isinstance(value, str) and "${" in value:
                continue  # interpolations are checked through their resolved users
            assert cfg[group][key] == value, f"{group}={option}: {key}"


@pytest.mark.parametrize("group", ["hardware", "model", "data", "parallelism", "optim"])
def test_no_option_restates_its_schemas_default(group):
    """Each fact in one place: a value an option file (shared bases included) gives a field is
    never the default its schema already gives it (xtrain/config/)."""
    import dataclasses
    import typing

    import yaml

    from xtrain.config import TrainConfig

    schema = typing.get_type_hints(TrainConfig)[group]
    defaults = {f.name: f.default.value if hasattr(f.default, "value") else f.default
                for f in dataclasses.fields(schema) if f.default is not dataclasses.MISSING}
    for path in sorted((CONF / group).glob("*.yaml")):
        declared = yaml.safe_load(path.read_text()) or {}
        restated = [k for k, v in declared.items() if k in defaults and v == defaults[k]]
        assert not restated, f"{path.name}: {restated} restate {schema.__name__}'s defaults"


def test_default_is_the_embedded_cpu_run(compose_config):
    cfg = compose_config()
    assert cfg.hardware.engine == "cpu" and cfg.hardware.name == "cpu"
    assert cfg.model.depth == 4 and cfg.data.name == "cpp_local" and cfg.mode == "train"
    assert cfg.run.name == "d4-cpu-cpp_local"


def test_run_name_keeps_groups_and_identity_overrides(compose_config, monkeypatch):
    cfg = compose_config(["model=d2", "optim.matrix_lr=0.01", "trainer.max_steps=7", "mode=plan"])
    # max_steps and mode do not change what is trained (resume keeps working); the LR does.
    assert cfg.run.name == "d2-cpu-cpp_local-optim.matrix_lr_0.01"
    # a model field does, even though its name starts like "mode"
    assert compose_config(["model.sequence_len=64"]).run.name == "d4-cpu-cpp_local-model.sequence_len_64"
    # how checkpoints are judged is not what is trained: mode=eval finds the trained run
    assert compose_config(["mode=eval", "eval.max_tokens=64", "eval.n=4"]).run.name == "d4-cpu-cpp_local"
    assert compose_config(["eval.cpp_every=500"]).run.name == "d4-cpu-cpp_local"
    # nor are the planner's estimates, the length in tokens per parameter, or the compile guard
    for neutral in ("hardware.hourly_usd_spot=2.5", "hardware.expected_mfu=0.4",
                    "trainer.target_tokens_per_param=30", "trainer.max_compiles=3", "trainer.profile=true"):
        assert compose_config([neutral]).run.name == "d4-cpu-cpp_local", neutral
    # an interpolated value is named as it resolves (a run of depth 8 is not the d4 run); one
    # built from the run's own name cannot be, and is left out
    monkeypatch.setenv("XTRAIN_TEST_DEPTH", "8")
    assert compose_config(["model.depth=${oc.env:XTRAIN_TEST_DEPTH}"]).run.name == \
        "d4-cpu-cpp_local-model.depth_8"
    assert compose_config(["model.depth=${oc.env:XTRAIN_TEST_DEPTH}", "data.name=${run.name}"]).run.name == \
        "d4-cpu-cpp_local-model.depth_8"
    # a string may be a secret: its digest names it; an enum's value is not one
    monkeypatch.setenv("XTRAIN_TEST_ATTENTION", "sdpa")
    assert compose_config(["model.attention=${oc.env:XTRAIN_TEST_ATTENTION}"]).run.name == \
        "d4-cpu-cpp_local-model.attention_sdpa"
    monkeypatch.setenv("XTRAIN_TEST_PATTERN", "SSSL")
    assert compose_config(["model.window_pattern=${oc.env:XTRAIN_TEST_PATTERN}"]).run.name == \
        "d4-cpu-cpp_local-model.window_pattern_sha-" + hashlib.sha256(b"SSSL").hexdigest()[:8]
    # training from another run's checkpoint continues this run; sampling or judging one logs
    # with the run it belongs to, not in the dir of the run these groups train
    resume = "checkpoint.resume=/r/x/checkpoints/step_000030"
    assert compose_config([resume]).run.name == "d4-cpu-cpp_local"
    long_path = "/" + "/".join(["a_long_dir_name"] * 12) + "/a-sweep,job/checkpoints/step_000003"
    for mode in ("sample", "eval"):
        assert compose_config([f"mode={mode}", resume]).run.name == "x"
        for none in ("null", "''"):  # no checkpoint named: the run's own newest
            assert compose_config([f"mode={mode}", f"checkpoint.resume={none}"]).run.name == "d4-cpu-cpp_local"
        assert compose_config([f"mode={mode}", "checkpoint.resume=gs://b/ckpt/y/step_000010"]).run.name == "y"
        assert compose_config([f"mode={mode}", f"checkpoint.resume='{long_path}'"]).run.name == "a-sweep,job"
        # interpolated, as resolved (a path from the environment), also when it names this run
        monkeypatch.setenv("XTRAIN_TEST_CK", "gs://b/ckpt/z/step_000010")
        assert compose_config([f"mode={mode}", "checkpoint.resume=${oc.env:XTRAIN_TEST_CK}"]).run.name == "z"
        assert compose_config([f"mode='{mode}'", "checkpoint.resume=${oc.env:XTRAIN_TEST_CK}"]).run.name == "z"
        for own in ("/r/${run.name}/step_000010", "/r/${run.name}x/step_000010"):  # named by groups
            cfg = compose_config([f"mode={mode}", f"checkpoint.resume={own}"])
            assert cfg.run.name == "d4-cpu-cpp_local"
            assert cfg.checkpoint.resume == own.replace("${run.name}", "d4-cpu-cpp_local")
    # no path separators, and nothing storage tools read as a pattern (a checkpoint.dir of
    # gs://b/${run.name} is removed from by retention)
    name = compose_config(["data.train_files='gs://b/t/[0-9]*?.parquet'"]).run.name
    assert name == "d4-cpu-cpp_local-data.train_files__gs:__b_t__0-9___.parquet_"


def test_a_shortened_name_stays_what_runs_already_trained_under_it_are_named():
    """Runs resume by name (their dir, their checkpoint.dir): a name too long for a file keeps the
    form it had when it trained (the value below was given by xtrain before 2026-11-29)."""
    from xtrain.naming import compose_name

    choices = {"model": "d2", "hardware": "cpu", "data": "cpp_local"}
    overrides = [f"optim.{key}={value}" for key, value in (
        ("adam_beta1", 0.8123456), ("adam_beta2", 0.9512345), ("embedding_lr", 0.1234567),
        ("grad_clip", 0.9876543), ("matrix_lr", 0.0123456789))] + ["trainer.max_steps=200"]
    assert compose_name(choices, overrides, sweep=True) == (
        "d2-cpu-cpp_local-optim.adam_beta1_0.8123456-optim.adam_beta2_0.9512345-optim.embedding_lr_"
        "0.1234567-optim.g-40a6818cf057")
    # another value of a part cut off still gives another name
    assert compose_name(choices, overrides[:-1] + ["trainer.max_steps=300"], sweep=True) != \
        compose_name(choices, overrides, sweep=True)


def hydra_section(config_name: str = "train", main_dir: str = str(CONF), *more_dirs: str):
    """The parts of a composed config's ``hydra`` section that name a run: the primary config's
    name and the config dirs Hydra searched (as Hydra records them)."""
    from omegaconf import OmegaConf

    sources = [{"path": "hydra.conf", "schema": "pkg", "provider": "hydra"},
               {"path": main_dir, "schema": "file", "provider": "main"},
               *({"path": d, "schema": "file", "provider": "command-line"} for d in more_dirs)]
    return OmegaConf.create({"job": {"config_name": config_name}, "runtime": {"config_sources": sources}})


def test_a_sweeps_dir_is_named_by_its_command_line(monkeypatch):
    from xtrain.naming import sweep_dir_name

    def name(*args, hydra_cfg=hydra_section()):
        monkeypatch.setattr(sys, "argv", ["xtrain", "-m", *args])
        return sweep_dir_name(hydra_cfg)

    assert name("model=d2", "optim.matrix_lr=0.01,0.02") == "d2-optim.matrix_lr_0.01,0.02"
    assert name("trainer.max_steps=3,6") == "trainer.max_steps_3,6"  # every override
    assert name("~logger.wandb", "optim.matrix_lr=0.01") != name("optim.matrix_lr=0.01")
    # not Hydra's own (a launch or its stop is the same sweep), not what resolves in each job
    assert name("hydra/launcher=tpu_vm", "hydra.launcher.stop=true", "model=d2") == "d2"
    assert name("optim.embedding_lr=${optim.matrix_lr}", "optim.matrix_lr=0.01,0.02") == \
        "optim.matrix_lr_0.01,0.02"
    assert name() == "defaults"
    # another primary config sets what is trained in its body: a sweep of it is another sweep,
    # though the command's overrides are the same; conf/train.yaml however it is spelled is not
    for spelled in ("train.yaml", "/train"):
        assert name("model=d2", hydra_cfg=hydra_section(spelled)) == "d2"
    for spelled in ("ablation", "ablation.yaml"):
        assert name("model=d2", hydra_cfg=hydra_section(spelled, str(CONF), "/my/conf")) == "d2-ablation"
    assert name(hydra_cfg=hydra_section("ablation")) == "ablation"
    assert name(hydra_cfg=hydra_section("train", "/a/copy/of/conf")) == "train"  # --config-path
    assert name(hydra_cfg=hydra_section("train", str(CONF), "/my/conf")) == "defaults"  # groups only
    # a relative --config-path is a package to Hydra: there, another package's configs
    elsewhere = hydra_section()
    elsewhere.runtime.config_sources[1] = {"path": "tests/fixtures", "schema": "pkg", "provider": "main"}
    assert name(hydra_cfg=elsewhere) == "train"


def test_another_primary_config_names_its_runs_and_sweeps(tmp_path):
    """A config given by --config-name (or --config-path) trains what its body sets (here a
    learning rate), which no override shows: its runs and sweeps are named by it, or they would
    resume (and overwrite) the checkpoints of conf/train.yaml's runs."""
    import shutil

    (tmp_path / "ablation.yaml").write_text("defaults:\n  - train\n  - _self_\noptim:\n  matrix_lr: 0.05\n")
    shutil.copytree(CONF, tmp_path / "copy")
    with open(tmp_path / "copy" / "train.yaml", "a") as f:
        f.write("optim:\n  matrix_lr: 0.07\n")
    chosen = ["--config-dir", str(tmp_path), "--config-name", "ablation"]
    for command, name, lr in [(chosen, "d4-cpu-cpp_local-ablation", 0.05),
                              (["--config-path", str(tmp_path / "copy")], "d4-cpu-cpp_local-train", 0.07),
                              (["--config-name", "train.yaml"], "d4-cpu-cpp_local", 0.02)]:
        r = _cli(*command, "--cfg", "job", "--resolve")
        assert r.returncode == 0, r.stderr
        assert f"\nrun:\n  name: {name}\n" in r.stdout and f"matrix_lr: {lr}\n" in r.stdout
    r = subprocess.run([sys.executable, "-m", "xtrain", "-m", *chosen, "mode=plan"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert f" -> {tmp_path}/multirun/ablation-mode_plan/" in r.stdout, r.stdout


def test_a_job_may_read_its_sweep_dir(tmp_path):
    """The sweep dir's name resolves in a job's config too, also where Hydra (--cfg job) or the
    sweep's checks hold the job's config apart from its hydra section."""
    reads = "checkpoint.dir=${hydra:sweep.dir}/ckpt"
    r = _cli("--cfg", "job", "--resolve", reads)
    assert r.returncode == 0, r.stderr
    assert "  dir: multirun/defaults/ckpt\n" in r.stdout
    r = subprocess.run([sys.executable, "-m", "xtrain", "-m", "mode=plan", reads, "optim.matrix_lr=0.01,0.02"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert f" -> {tmp_path}/multirun/mode_plan-optim.matrix_lr_0.01,0.02/" in r.stdout, r.stdout
    assert not (tmp_path / "multirun").exists()  # plans keep nothing, the sweep's record neither


def test_a_sweep_of_plans_puts_back_the_record_of_an_earlier_sweep_in_its_dir(tmp_path):
    """Hydra writes multirun.yaml before the jobs run; a sweep whose jobs keep nothing (plans)
    leaves the sweep dir as it found it (xtrain/sweeps.py SweepRecord)."""
    sweep_dir = tmp_path / "sweeps" / "lr"
    (sweep_dir / "an_earlier_job").mkdir(parents=True)  # (the record is not alone in its dir)
    (sweep_dir / "multirun.yaml").write_text("an earlier sweep's record\n")
    r = subprocess.run([sys.executable, "-m", "xtrain", "-m", "mode=plan", f"hydra.sweep.dir={sweep_dir}",
                        "optim.matrix_lr=0.01,0.02"], cwd=tmp_path, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.count(f" -> {sweep_dir}/") == 2, r.stdout
    assert sorted(p.name for p in sweep_dir.iterdir()) == ["an_earlier_job", "multirun.yaml"]
    assert (sweep_dir / "multirun.yaml").read_text() == "an earlier sweep's record\n"
    # also when a job's plan is refused as it runs (d26 does not fit one v6e chip at batch 64)
    r = subprocess.run([sys.executable, "-m", "xtrain", "-m", "mode=plan", f"hydra.sweep.dir={sweep_dir}",
                        "hardware=v6e1", "trainer.device_batch_size=64", "model=d12,d26"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert r.returncode == EXIT_REFUSED and "does not fit" in r.stderr, r.stderr
    assert sorted(p.name for p in sweep_dir.iterdir()) == ["an_earlier_job", "multirun.yaml"]
    assert (sweep_dir / "multirun.yaml").read_text() == "an earlier sweep's record\n"


@pytest.mark.parametrize("subdir", ["{tmp_path}/elsewhere/${{hydra.job.num}}",
                                    "../../elsewhere/${{hydra.job.num}}", "."],
                         ids=["absolute", "climbing", "the-sweep-dir"])
def test_a_sweep_whose_jobs_dirs_would_lie_outside_its_dir_is_refused(tmp_path, subdir):
    """A sweep's record and xtrain.report find its jobs in its dir, one dir each. Jobs put
    elsewhere by hydra.sweep.subdir trained there, and their sweep dir, left with its record
    alone, was removed as that of a sweep that kept nothing: refused before any job runs (the
    first job's number, 0, as its dir would have it)."""
    subdir = subdir.format(tmp_path=tmp_path)
    r = subprocess.run([sys.executable, "-m", "xtrain", "-m", "model=d2", "trainer.max_steps=1",
                        "optim.matrix_lr=0.01,0.02", f"hydra.sweep.subdir={subdir}"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == EXIT_REFUSED, r.stderr
    first = subdir.replace("${hydra.job.num}", "0")
    assert (f"sweep job 1 of 2 (model=d2 trainer.max_steps=1 optim.matrix_lr=0.01): "
            f"hydra.sweep.subdir={first} puts the job in ") in r.stderr, r.stderr
    assert "not in a dir of its own inside the sweep's dir multirun/" in r.stderr
    assert len(r.stderr.splitlines()) == 1, r.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("subdir", ["multirun.yaml", "multirun.yaml/${hydra.job.num}"])
def test_a_sweep_whose_jobs_dir_is_its_record_is_refused(tmp_path, subdir):
    """hydra.sweep.subdir=multirun.yaml: Hydra's record of the sweep, a file, where the job's
    dir would go (a FileExistsError traceback as the first job started)."""
    r = subprocess.run([sys.executable, "-m", "xtrain", "-m", "mode=plan", "optim.matrix_lr=0.01,0.02",
                        f"hydra.sweep.subdir={subdir}"], cwd=tmp_path, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == EXIT_REFUSED, r.stderr
    assert r.stderr.startswith("xtrain: ") and len(r.stderr.splitlines()) == 1, r.stderr
    assert (f"hydra.sweep.subdir={subdir.replace('${hydra.job.num}', '0')} puts the job in "
            "multirun/") in r.stderr and "where Hydra keeps the sweep's record" in r.stderr, r.stderr
    assert list(tmp_path.iterdir()) == []


def test_a_sweep_whose_jobs_would_train_in_one_checkpoint_dir_is_refused(tmp_path):
    """Two trainings in one checkpoint dir take each other's checkpoints: a sweep giving its jobs
    one checkpoint.dir is refused before any job runs; the run's name in it keeps them apart."""
    sweep = [sys.executable, "-m", "xtrain", "-m", "model=d2", "trainer.max_steps=1",
             "optim.matrix_lr=0.01,0.02"]
    r = subprocess.run([*sweep, f"checkpoint.dir={tmp_path}/ckpt"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == EXIT_REFUSED, r.stderr
    assert (f"sweep job 2 of 2 (model=d2 trainer.max_steps=1 optim.matrix_lr=0.02 checkpoint.dir="
            f"{tmp_path}/ckpt): checkpoint.dir={tmp_path}/ckpt is sweep job 1's too: "
            "two trainings in one checkpoint dir take each other's checkpoints; give each job its "
            f"own, e.g. 'checkpoint.dir={tmp_path}/ckpt/${{run.name}}'") in r.stderr
    assert not (tmp_path / "ckpt").exists() and not (tmp_path / "multirun").exists()
    # one dir written two ways (relative here, and as a file:// URL)
    r = subprocess.run([*sweep[:-1], f"checkpoint.dir=ckpt,file://{tmp_path}/ckpt/"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == EXIT_REFUSED, r.stderr
    assert f"checkpoint.dir=file://{tmp_path}/ckpt is sweep job 1's too" in r.stderr
    tiny = ["model.sequence_len=64", "trainer.device_batch_size=4", "trainer.sample_tokens=0",
            "trainer.eval_tokens=256"]
    for allowed in [f"checkpoint.dir={tmp_path}/ckpt/${{run.name}}",  # (trains both)
                    f"checkpoint.dir={tmp_path}/plans mode=plan"]:  # (no checkpoint)
        r = subprocess.run([*sweep, *tiny, *allowed.split()], cwd=tmp_path, capture_output=True,
                           text=True, timeout=300)
        assert r.returncode == 0, r.stderr
    assert len(list((tmp_path / "ckpt").glob("*/step_000001/COMMITTED"))) == 2


def test_a_sweep_whose_jobs_share_a_run_name_is_refused(tmp_path):
    """Jobs given one run.name share a run dir and so its checkpoints: the second would resume the
    first's finished training and record its own settings over it. Refused before any job runs."""
    sweep = [sys.executable, "-m", "xtrain", "-m", "model=d2", "trainer.max_steps=1",
             "optim.matrix_lr=0.01,0.02"]
    r = subprocess.run([*sweep, "run.name=lr_sweep"], cwd=tmp_path, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == EXIT_REFUSED, r.stderr
    assert ("sweep job 2 of 2 (model=d2 trainer.max_steps=1 optim.matrix_lr=0.02 run.name=lr_sweep): "
            "sweep job 1 is run lr_sweep too (its checkpoints in multirun/") in r.stderr
    assert not (tmp_path / "multirun").exists()
    # jobs named apart but put in one dir: that dir is what they share, not a name
    r = subprocess.run([*sweep, "hydra.sweep.subdir=x"], cwd=tmp_path, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == EXIT_REFUSED, r.stderr
    assert re.search(r"sweep job 1 \(run d2-\S+matrix_lr_0\.01\S*\) has this job's run dir too \(its "
                     r"checkpoints in multirun/\S+/x/checkpoints\): .* give each job a dir of its "
                     r"own with hydra.sweep.subdir", r.stderr), r.stderr
    assert not (tmp_path / "multirun").exists()
    # checkpoint dirs apart do not keep apart the run dir's metrics.jsonl and console.log
    r = subprocess.run([*sweep, "run.name=lr_sweep", f"checkpoint.dir={tmp_path}/ckpt/${{optim.matrix_lr}}"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert r.returncode == EXIT_REFUSED, r.stderr
    assert re.search(r"^xtrain: .*sweep job 2 of 2 \(.*\): sweep job 1 has this job's run dir multirun/\S+/"
                     r"lr_sweep too: two trainings in one run dir write one metrics.jsonl", r.stderr), r.stderr
    assert not (tmp_path / "multirun").exists() and not (tmp_path / "ckpt").exists()
    # jobs in dirs of their own pass: one named per job, or a launcher's number per job (which
    # the check cannot resolve, and once refused)
    tiny = ["model.sequence_len=64", "trainer.device_batch_size=4", "trainer.sample_tokens=0",
            "trainer.eval_tokens=256"]
    r = subprocess.run([*sweep, *tiny, "run.name=lr_${optim.matrix_lr}", "hydra.sweep.subdir=${hydra.job.num}"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert len(list((tmp_path / "multirun").glob("*/[01]/checkpoints/step_000001/COMMITTED"))) == 2


def test_a_checkpoint_dir_with_pattern_characters_is_refused(tmp_path):
    from xtrain.checkpoint.layout import check_writable
    from xtrain.errors import ConfigError

    for directory in (f"{tmp_path}/runs/[a]", "gs://bucket/runs/x*"):
        with pytest.raises(ConfigError, match=r"holds one of \*\?\[\]: fsspec reads paths"):
            check_writable(directory)
    assert not (tmp_path / "runs").exists()


def test_overrides_reach_the_fields(compose_config):
    cfg = compose_config(["optim.matrix_lr=0.01", "trainer.max_steps=20", "model.n_kv_head=2"])
    assert cfg.optim.matrix_lr == 0.01 and cfg.trainer.max_steps == 20 and cfg.model.n_kv_head == 2


def _cli(*args, timeout=60, env=None):
    return subprocess.run([sys.executable, "-m", "xtrain", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


@pytest.mark.parametrize("args, printed", [
    (["model=d2", "--cfg", "job", "-p", "model.depth"], "2"),
    (["--info"], "structured://"),
])
def test_a_process_of_rank_above_0_reads_options_as_the_first_does(args, printed):
    """A process of RANK > 0 adds overrides of its own (no Hydra files in the shared run dir):
    beside the command's, which Hydra reads as one run; appended after an option, they were
    refused as unrecognized (or read as ``--info``'s value)."""
    r = _cli(*args, env={**os.environ, "RANK": "1"})
    assert r.returncode == 0, r.stderr[-2000:]
    assert printed in r.stdout.strip().splitlines()[-1] + r.stdout, r.stdout[-2000:]


def test_help_lists_groups_and_cfg_job_prints_config():
    """--help lists each group's choosable options (conf/<group>/*.yaml), never a base (_*.yaml:
    choosing one is refused)."""
    r = _cli("--help")
    assert r.returncode == 0
    conf = Path(__file__).resolve().parents[1] / "conf"
    for group in sorted(d for d in conf.iterdir() if d.is_dir()):
        options = sorted(f.stem for f in group.glob("*.yaml") if not f.stem.startswith("_"))
        assert f"\n{group.name}: {', '.join(options)}\n" in r.stdout
    assert "_tpu" not in r.stdout and "_gcs_nanochat" not in r.stdout
    r = _cli("--cfg", "job", "model=d16")
    assert r.returncode == 0 and "depth: 16" in r.stdout
    # the README's way to see Hydra's section resolved: the run dir holds the job's run.name
    r = _cli("--cfg", "all", "--resolve", "-p", "hydra", "model=d16")
    assert r.returncode == 0, r.stderr
    assert "\nrun:\n  dir: outputs/d16-cpu-cpp_local\n" in r.stdout


def test_cli_help_does_not_import_torch():
    code = ("import sys; sys.argv=['xtrain','--help']\n"
            "import xtrain.cli as c\n"
            "try:\n    c.main()\nexcept SystemExit:\n    pass\n"
            "assert 'torch' not in sys.modules, 'torch imported by --help'\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr


def test_tab_completion_of_the_console_script_lists_options_and_fields():
    """The README's completion command: Hydra completes the installed `xtrain` script, with the
    options that may be chosen (not the bases, such as hardware=_tpu)."""
    script = Path(sys.executable).with_name("xtrain")
    for shell in ("bash", "fish"):
        for line, expected in (("xtrain hardware=", {"hardware=v6e4", "hardware=cpu"}),
                               ("xtrain optim.mat", {"optim.matrix_lr="}),
                               ("xtrain data=", {"data=cpp16k", "data=cpp_local"}),
                               # an enum as a command line writes it, not Hydra's Mode.train
                               ("xtrain mode=", {"mode=train"}),
                               ("xtrain model.attention=", {"model.attention=auto"})):
            r = subprocess.run([str(script), "-sc", f"query={shell}"], capture_output=True, text=True,
                               timeout=60, env={**os.environ, "COMP_LINE": line})
            offered = set(r.stdout.split())
            assert expected <= offered, (shell, line, r.stdout, r.stderr[-500:])
            assert not any("=_" in word for word in offered), (shell, line, r.stdout)


@pytest.mark.parametrize("override, choices", [
    ("mode=nope", "train, plan, compile, sample, eval"),
    ("model.attention=nope", "auto, sdpa, chunked, flash, splash"),
])
def test_enum_fields_refuse_unknown_values_with_the_choices(override, choices):
    r = _cli(override)
    assert r.returncode == 2
    key = override.split("=")[0]
    assert r.stderr == f"xtrain: config error: {key}: Invalid value 'nope', expected one of [{choices}]\n"


def test_an_enum_written_as_its_member_is_refused_naming_the_plain_value():
    """OmegaConf reads model.attention=Attention.chunked as chunked, but the run would be named
    after the override as written: another dir than model.attention=chunked's."""
    r = _cli("model.attention=Attention.chunked")
    assert r.returncode == 2
    assert r.stderr == ("xtrain: config error: model.attention=Attention.chunked: write "
                        "model.attention=chunked (the run's name is made of the overrides as "
                        "written)\n")
    r = _cli("mode=plan", "sample.prompt=Engine.start")  # no member of Engine: a string
    assert r.returncode == 0, r.stderr[-2000:]


def test_the_plan_says_which_setting_sets_the_runs_length(compose_config):
    """trainer.max_steps wins over trainer.target_tokens_per_param; given both and disagreeing,
    the plan says the target is not used (it was silently ignored)."""
    from xtrain.plan import resolve

    lines = {}
    for name, overrides in (("both", ["trainer.target_tokens_per_param=20"]),
                            ("steps", []),
                            ("target", ["trainer.max_steps=null", "trainer.target_tokens_per_param=20"])):
        cfg = compose_config(overrides)
        plan = resolve(cfg, 1)
        lines[name] = next(line for line in plan.describe().splitlines() if line.startswith("steps:"))
        assert resolve(cfg, 1).describe() == plan.describe()  # resolving again changes nothing
    assert lines["both"].startswith("steps: 200 x ") and lines["both"].endswith(
        "; trainer.max_steps sets the length, not trainer.target_tokens_per_param=20")
    assert "target_tokens_per_param" not in lines["steps"] + lines["target"]
    assert "(20.00 tokens/param)" in lines["target"]
