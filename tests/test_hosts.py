"""Multi-host planning and launching, without training: the per-host view of mode=plan, the launch
variables a multi-process CPU run needs, what a secondary process leaves out, and the check that
every process sees the checkpoint directory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from xtrain.cli import secondary_process_overrides
from xtrain.errors import ConfigError
from xtrain.hardware import cpu_processes, launch_environment
from xtrain.plan import resolve

ROOT = Path(__file__).resolve().parent.parent


def test_pod_plan_says_what_each_host_loads_and_writes(compose_config):
    cfg = compose_config(["hardware=v4_32", "model=d16"])
    plan = resolve(cfg, cfg.hardware.chips)
    # v4 profile: 16,384 tokens per chip at 2,048 -> 8 rows per chip, 16 chips: 128 rows
    assert (plan.hosts, plan.batch.device_batch_size * plan.batch.data_parallel) == (4, 128)
    text = plan.describe()
    assert "hosts: 4, one process each (4 devices per host); host h:" in text
    assert "loads: rows 32h..32h+31 of each micro-batch's 128" in text
    assert "torch_xla's per-host input sharding" in text
    assert "reads on resume: the checkpoint's metadata and only the files holding its shards" in text
    assert "host 0 alone also writes metrics.jsonl" in text
    cfg = compose_config(["hardware=v4_32", "model=d16", "parallelism=fsdp_tp"])
    text = resolve(cfg, cfg.hardware.chips).describe()  # batch replicated over tensor=2
    assert "loads: all 64 rows of each micro-batch" in text
    single = compose_config(["hardware=v6e4", "model=d16"])
    assert "host h:" not in resolve(single, 4).describe()


def test_cpu2_plans_anywhere_but_trains_only_when_launched(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "MASTER_ADDR",
                                                             "MASTER_PORT")}
    plan = subprocess.run([sys.executable, "-m", "xtrain", "hardware=cpu2", "mode=plan",
                           f"hydra.run.dir={tmp_path}/plan"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert plan.returncode == 0, plan.stderr[-2000:]
    assert "processes: 2, one process each (1 device per process); process h:" in plan.stdout
    assert "trains a full replica, gradients averaged over gloo (DDP)" in plan.stdout
    train = subprocess.run([sys.executable, "-m", "xtrain", "hardware=cpu2",
                            f"hydra.run.dir={tmp_path}/train"], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=120)
    assert train.returncode == 2
    assert [line for line in train.stderr.splitlines() if line.startswith("xtrain:")] == [
        "xtrain: config error: hardware=cpu2 runs 2 processes; MASTER_ADDR, MASTER_PORT, "
        "WORLD_SIZE, RANK not set: start each process with MASTER_ADDR, MASTER_PORT, WORLD_SIZE=2 "
        "and RANK=0..1, or `torchrun --standalone --nproc-per-node 2 -m xtrain ...` on one machine"]
    assert not (tmp_path / "train" / "metrics.jsonl").exists()


def test_launch_variables_are_checked(compose_config):
    cpu, cpu2 = compose_config([]).hardware, compose_config(["hardware=cpu2"]).hardware
    assert cpu_processes(cpu, {}) == 1 and cpu_processes(cpu2, {}) == 2
    assert cpu_processes(cpu, {"WORLD_SIZE": "3"}) == 3  # the environment decides for `cpu`
    with pytest.raises(ConfigError, match="WORLD_SIZE=3 but hardware=cpu2 has 2 hosts"):
        cpu_processes(cpu2, {"WORLD_SIZE": "3"})
    launch = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "WORLD_SIZE": "2", "RANK": "1"}
    assert launch_environment(cpu2, launch) == (1, 2, "127.0.0.1", 29500)
    with pytest.raises(ConfigError, match="RANK=2 is not below WORLD_SIZE=2"):
        launch_environment(cpu2, {**launch, "RANK": "2"})
    with pytest.raises(ConfigError, match=r"MASTER_PORT='x': expected an integer in 1\.\.65535"):
        launch_environment(cpu2, {**launch, "MASTER_PORT": "x"})


def test_only_the_first_process_writes_hydra_files():
    assert secondary_process_overrides({}) == []
    assert secondary_process_overrides({"RANK": "0"}) == []
    assert secondary_process_overrides({"RANK": "00"}) == []  # as launch_environment reads it
    assert secondary_process_overrides({"RANK": "1"}) == ["hydra.output_subdir=null",
                                                          "hydra/job_logging=stdout"]


def _check(rank: int, world: int, init: str, directory: str, out_dir: str) -> None:
    import torch.distributed as dist

    from xtrain.checkpoint.layout import check_shared
    from xtrain.engines.processes import Processes

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        check_shared(directory.replace("RANK", str(rank)), Processes(rank, world, dist.group.WORLD))
        outcome = "ok"
    except ConfigError as e:
        outcome = str(e)
    dist.destroy_process_group()
    Path(out_dir, f"{rank}.json").write_text(json.dumps(outcome))


@pytest.mark.parametrize("shared", [True, False])
def test_a_checkpoint_dir_not_every_process_sees_is_refused(tmp_path, shared):
    import torch.multiprocessing as mp

    directory = str(tmp_path / ("ckpt" if shared else "ckpt-of-RANK"))  # RANK: a per-host disk
    out = tmp_path / "out"
    out.mkdir()
    mp.spawn(_check, args=(2, f"file://{tmp_path}/rendezvous", directory, str(out)), nprocs=2)
    outcomes = [json.loads((out / f"{r}.json").read_text()) for r in range(2)]
    if shared:
        assert outcomes == ["ok", "ok"] and not list((tmp_path / "ckpt").iterdir())
    else:
        assert all("is not shared by the run's 2 processes" in o for o in outcomes), outcomes
