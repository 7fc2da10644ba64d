"""The spot fleet end to end: preempted VMs recreated, jobs re-run and resumed from GCS, failures
told apart from preemptions, sweeps spread over a pool.

Real OpenSSH on loopback (tests/sshd.py: sshd on 127.0.0.2 and 127.0.0.3, each address a host
with its own remote directory; this module has its own sshd, because a recreated VM gets a new
host key and the stand-in rotates this server's), real training, and a real GCS API
(fake-gcs-server, the ``gcs_bucket`` fixture) that the remote jobs reach on 127.0.0.1. Only
``gcloud`` is a stand-in (tests/gcloud_standin.py), because Google Cloud cannot be reached from
here: it replays VM states from a scenario and records its calls. A preemption is the test
flipping the VM's state in the stand-in to PREEMPTED and SIGKILLing the remote job, which is
what a spot VM going away does to the job; the "recreated" VM is the same loopback host, whose
job, run and code directories the stand-in's delete empties (a new VM has an empty disk).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from conftest import gcs_client_env, gcs_filesystem
from tests.sshd import (HOSTS, Remote, Sshd, gcloud, live_group, ssh_processes,  # noqa: F401
                        stack_venv, tpu_node)
from xtrain.cli import config_dir
from xtrain.paths import PRIMARY_CONFIG
from xtrain.launcher.config import LauncherConfig
from xtrain.launcher.fleet import Job, run_on_vm
from xtrain.launcher.runner import LaunchError

ROOT = Path(__file__).resolve().parent.parent
LAUNCH = ROOT / "launch"
if str(LAUNCH) not in sys.path:  # until the plugin is installed with the package
    sys.path.insert(0, str(LAUNCH))
ZONE = "asia-northeast1-b"
STEPS = 60  # about 0.05 s a step here: room to act between a checkpoint and the end
EVERY = 20
TINY = ["model=d2", "model.sequence_len=64", "trainer.device_batch_size=4", "trainer.log_every=1",
        "trainer.sample_tokens=0", "trainer.eval_tokens=256", "optim.warmup_steps=3"]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, xtrain_cache):
    """Two loopback hosts behind this module's own sshd, sharing one venv that reaches this
    machine's stack (a recreated VM's disk is emptied, the venv is kept: installing torch from
    PyPI is not possible here)."""
    server = Sshd(tmp_path_factory.mktemp("fleet-sshd")).start()
    base = tmp_path_factory.mktemp("fleet-remote")
    remote = Remote(base, server, xtrain_cache)
    remote.venv = stack_venv(base / "venv")
    yield remote
    for pid in base.glob("hosts/*/jobs/*/pid"):  # a failed test's job must not train on
        group = pid.read_text().strip()
        if group.isdigit() and int(group) > 1 and live_group(int(group)):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(int(group), signal.SIGKILL)
    server.stop()


def fields(fleet, tmp_path, bucket=None, **extra) -> dict:
    """Launcher fields for the fleet hosts beyond tests/sshd.py's: a TPU name instead of
    addresses, fast polling, this test's own known_hosts, the GCS emulator for the remote job."""
    env = {"XTRAIN_CACHE": fleet.cache}
    if bucket:  # the remote job reaches the emulator as this process does (tests/conftest.py)
        env.update({k: v for k, v in gcs_client_env(os.environ["STORAGE_EMULATOR_HOST"],
                                                    os.environ["CLOUDSDK_CONFIG"]).items() if v})
    return dict(hosts=[], zone=ZONE, venv=str(fleet.venv), known_hosts=str(tmp_path / "known_hosts"),
                tpu_lockfile=str(tmp_path / "libtpu_lockfile"), poll_s=0.2, capacity_backoff_s=0.5,
                ready_timeout_s=120, env=env, **extra)


def vm_job(fleet, tmp_path, compose_config, overrides, name, bucket=None, **extra) -> Job:
    """A job for run_on_vm. The launcher sees a v6e-4 profile (what gcloud creates) while the
    job itself trains on this machine's CPU (the loopback "VM" has no TPU)."""
    cfg = OmegaConf.structured(LauncherConfig(**fleet.launcher_fields(
        **fields(fleet, tmp_path, bucket, tpu="vm-a", **extra))))
    hardware = compose_config(["hardware=cpu", "hardware.accelerator_type=v6e-4",
                               "hardware.runtime_version=v2-alpha-tpuv6e"]).hardware
    given = [o.split("=", 1)[1] for o in overrides if o.startswith("checkpoint.dir=")]
    return Job(cfg, hardware, overrides + [f"run.name={name}"], name, str(tmp_path / "local" / name),
               given[-1] if given else None)


def in_background(fn):
    """Run ``fn`` in a thread; returns a function that waits for it and returns or raises."""
    out = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as e:  # noqa: BLE001  (handed to the test)
            out["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()

    def wait(timeout=300):
        thread.join(timeout)
        assert not thread.is_alive(), "the launch did not end"
        if "error" in out:
            raise out["error"]
        return out["value"]
    return wait


def wait_for(predicate, timeout=240.0, what="condition"):
    deadline = time.time() + timeout
    while not (value := predicate()):
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)
    return value


def job_dir(fleet, job: str, host=HOSTS[0]) -> Path:
    return fleet.root(host) / "jobs" / job


def started(fleet, job: str, host=HOSTS[0], other_than=None) -> int:
    """The remote job's process group, once an attempt (other than ``other_than``) started."""
    pid = job_dir(fleet, job, host) / "pid"

    def read():
        try:
            value = int(pid.read_text().strip() or 0)
        except (OSError, ValueError):
            return None
        return value if value and value != other_than else None
    return wait_for(read, what=f"{pid}")


def logged_step(fleet, job: str, host=HOSTS[0]) -> int:
    log = job_dir(fleet, job, host) / "log"
    steps = [int(line.split()[1].split("/")[0]) for line in
             (log.read_text().splitlines() if log.exists() else []) if line.startswith("step ")
             and "| loss" in line]
    return steps[-1] if steps else 0


def committed(url: str) -> bool:
    return gcs_filesystem(url).exists(url + "/COMMITTED")


def preempt(gcloud, name: str, pgid: int) -> None:
    """What a spot preemption does: the VM's state changes, its processes die without a word."""
    gcloud.set_state(name, "PREEMPTED")
    os.killpg(pgid, signal.SIGKILL)


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def losses(rows) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def ssh_streams(marker: str) -> list[int]:
    """Local ssh clients following (``tail``) a log whose path contains ``marker``."""
    return [pid for pid in ssh_processes(marker)
            if b"tail" in Path(f"/proc/{pid}/cmdline").read_bytes()]


@pytest.mark.slow  # about 70 s and 110 s here (real training over ssh, twice)
def test_a_preempted_vm_is_recreated_and_the_rerun_resumes_to_the_same_loss(
        fleet, gcloud, gcs_bucket, tmp_path, compose_config):
    bucket, _ = gcs_bucket
    run = TINY + [f"trainer.max_steps={STEPS}", f"checkpoint.every={EVERY}"]
    straight = subprocess.run(
        [sys.executable, "-m", "xtrain", *run, f"checkpoint.dir={bucket}/straight",
         f"hydra.run.dir={tmp_path / 'straight'}"], cwd=ROOT, capture_output=True, text=True,
        timeout=600)
    assert straight.returncode == 0, straight.stderr[-3000:]
    reference = losses(read_jsonl(tmp_path / "straight" / "metrics.jsonl"))
    host = fleet.root(HOSTS[0])
    gcloud.add(tpu_node("vm-a", ZONE, "v6e-4", [(HOSTS[0], HOSTS[0])]))
    gcloud.scenario("vm-a", creates=["no-capacity", "ok"], states=["CREATING", "READY"],
                    endpoints=[[HOSTS[0], HOSTS[0]]], host_key=str(fleet.sshd.host_key),
                    authorized_keys=str(fleet.sshd.dir / "authorized_keys"), keys_after_s=3,
                    wipe=[str(host / d) for d in ("jobs", "runs", "code")])
    old_key = Path(f"{fleet.sshd.host_key}.pub").read_text().split()[1]
    job = vm_job(fleet, tmp_path, compose_config, run + [f"checkpoint.dir={bucket}/resume"],
                 "fleet-resume", bucket, recreate=True)
    messages = []
    wait = in_background(lambda: run_on_vm(job, log=messages.append))
    pgid = started(fleet, "fleet-resume")
    run_id = (Path(job.job_dir) / "wandb-run-id").read_text()
    wait_for(lambda: committed(f"{bucket}/resume/step_{EVERY:06d}"), what="a checkpoint on GCS")
    os.killpg(pgid, signal.SIGSTOP)  # hold the job mid-run while the test plays the network
    assert logged_step(fleet, "fleet-resume") < STEPS, "the job must still be running"
    # a network drop first: the VM is READY and the job runs, so the launcher reattaches
    (stream,) = wait_for(lambda: ssh_streams("fleet-resume/log"), what="the log stream")
    os.kill(stream, signal.SIGKILL)
    wait_for(lambda: ssh_streams("fleet-resume/log") not in ([], [stream]), what="a new stream")
    # the job is stopped: its committed checkpoints are what a preemption now leaves behind
    newest = max(s for s in range(EVERY, STEPS, EVERY) if committed(f"{bucket}/resume/step_{s:06d}"))
    preempt(gcloud, "vm-a", pgid)
    result = wait()

    seen = max(int(line.split()[1].split("/")[0]) for line in
               (Path(job.job_dir) / "worker-0.preempted-1.log").read_text().splitlines()
               if line.startswith("step ") and "| loss" in line)
    rerun = read_jsonl(Path(job.job_dir) / "metrics.jsonl")
    resumed_at = rerun[0]["step"]  # the re-run's first record: the checkpoint it resumed from
    assert resumed_at == newest <= seen < STEPS  # (the re-run prunes it later: keep_last)
    assert result["loss"] == reference[STEPS]  # bitwise, on the CPU engine
    assert losses(rerun) == {s: reference[s] for s in range(resumed_at + 1, STEPS + 1)}
    assert {"preemptions": 1, "steps_redone": seen - resumed_at}.items() <= rerun[0].items()
    assert 0.5 <= rerun[0]["time_lost_s"] < 120 and result["preemptions"] == 1
    creates = [c for c in gcloud.calls() if c[3] == "create"]
    assert [c[:-1] for c in creates] == 2 * [["compute", "tpus", "tpu-vm", "create", "vm-a",
                                              f"--zone={ZONE}", "--accelerator-type=v6e-4",
                                              "--version=v2-alpha-tpuv6e", "--spot"]]
    # the login key goes with the new VM (the stand-in lets only it in, 3 s after the create, as
    # the VM's guest agent would: the launcher waits for it)
    assert all(c[-1].startswith("--metadata-from-file=ssh-keys=") for c in creates)
    verbs = [c[3] for c in gcloud.calls() if c[3] != "describe"]
    assert verbs == ["delete", "create", "create"]
    text = "\n".join(messages)
    assert "log stream cut; the job is still running, reattaching" in text
    assert f"TPU vm-a is PREEMPTED: job fleet-resume preempted at step {seen}" in text
    assert "no capacity" in text and "TPU vm-a is READY again" in text
    assert "re-running fleet-resume on TPU vm-a" in text
    # its checkpoints outlived the VM: the re-run continues the job's W&B run, not started over
    assert "no trace of it" not in text
    assert (Path(job.job_dir) / "wandb-run-id").read_text() == run_id
    new_key = Path(f"{fleet.sshd.host_key}.pub").read_text().split()[1]
    known = (tmp_path / "known_hosts").read_text()
    assert new_key != old_key and new_key in known and old_key not in known


def test_a_failed_job_on_a_ready_vm_is_a_failure_not_a_preemption(
        fleet, gcloud, tmp_path, compose_config):
    gcloud.add(tpu_node("vm-a", ZONE, "v6e-4", [(HOSTS[0], HOSTS[0])]))
    blocker = fleet.root(HOSTS[0]) / "runs" / "fleet-fail"
    blocker.parent.mkdir(parents=True, exist_ok=True)
    blocker.write_text("in the way: the job cannot make its run dir\n")
    job = vm_job(fleet, tmp_path, compose_config, TINY + ["trainer.max_steps=5"], "fleet-fail",
                 recreate=True)
    messages = []
    try:
        with pytest.raises(LaunchError, match=r"worker 0 \(127.0.0.2\) failed \(exit code 1\)"):
            run_on_vm(job, log=messages.append)
    finally:
        blocker.unlink()
    assert not [c for c in gcloud.calls() if c[3] in ("create", "delete")]
    assert not any("preempted" in m for m in messages)


def test_a_job_preempted_more_often_than_max_recreates_ends_clearly(
        fleet, gcloud, tmp_path, compose_config):
    gcloud.add(tpu_node("vm-a", ZONE, "v6e-4", [(HOSTS[0], HOSTS[0])]))
    gcloud.scenario("vm-a", endpoints=[[HOSTS[0], HOSTS[0]]])
    job = vm_job(fleet, tmp_path, compose_config, TINY + ["trainer.max_steps=100000"],
                 "fleet-budget", recreate=True, max_recreates=1)
    wait = in_background(lambda: run_on_vm(job, log=print))
    first = started(fleet, "fleet-budget")
    preempt(gcloud, "vm-a", first)
    second = started(fleet, "fleet-budget", other_than=first)  # on the recreated VM
    preempt(gcloud, "vm-a", second)
    with pytest.raises(LaunchError) as e:
        wait(timeout=120)  # an uncounted preemption would recreate and train on
    assert str(e.value).startswith("job fleet-budget: preempted 2 times, more than "
                                   "hydra.launcher.max_recreates=1: giving up")
    assert [c[3] for c in gcloud.calls() if c[3] != "describe"] == ["delete", "create"]
    assert live_group(second) == []


@pytest.mark.slow  # about 70 s and 110 s here (real training over ssh, twice)
def test_a_sweep_over_a_pool_requeues_the_preempted_job_and_finishes_all(
        fleet, gcloud, gcs_bucket, hydra_sweep_runner, tmp_path, monkeypatch, capsys):
    """Three jobs over two VMs through Hydra's multirun and the plugin; vm-a is preempted under
    its first job, which is requeued to vm-b and resumes there from its checkpoint on GCS."""
    import hydra_plugins.xtrain_launchers.tpu  # noqa: F401  (registers hydra/launcher=tpu_vm)

    bucket, _ = gcs_bucket
    gcloud.add(tpu_node("vm-a", ZONE, "v6e-4", [(HOSTS[0], HOSTS[0])]))
    gcloud.add(tpu_node("vm-b", ZONE, "v6e-4", [(HOSTS[1], HOSTS[1])]))
    monkeypatch.chdir(tmp_path)
    overrides = TINY + [f"trainer.max_steps={STEPS}", f"checkpoint.every={EVERY}",
                        "optim.matrix_lr=0.01,0.02,0.03",
                        f"checkpoint.dir='{bucket}/pool/${{run.name}}'"]
    overrides += fleet.overrides("tpu_vm", **fields(fleet, tmp_path, bucket, pool=["vm-a", "vm-b"]))
    preempted = {}
    jobs, runs = fleet.root(HOSTS[0]) / "jobs", fleet.root(HOSTS[0]) / "runs"
    earlier = set(jobs.glob("*"))  # the other tests' jobs on the same host

    def preempt_vm_a():
        job = wait_for(lambda: next((d.name for d in jobs.glob("*")
                                     if d not in earlier and (d / "pid").exists()), None),
                       what="a job on vm-a")
        config = wait_for(lambda: (runs / job / ".hydra" / "config.yaml").exists() and
                          OmegaConf.load(runs / job / ".hydra" / "config.yaml"), what="its run")
        wait_for(lambda: committed(f"{bucket}/pool/{config.run.name}/step_{EVERY:06d}"),
                 what="its first checkpoint")
        pgid = int((jobs / job / "pid").read_text())
        preempted.update(job=job, run=config.run.name, step=logged_step(fleet, job))
        preempt(gcloud, "vm-a", pgid)

    watched = in_background(preempt_vm_a)
    sweep = hydra_sweep_runner(calling_file=__file__, calling_module=None, task_function=None,
                               config_path=config_dir(), config_name=PRIMARY_CONFIG,
                               overrides=overrides, temp_dir=tmp_path / "multirun")
    with sweep:  # leaving it deletes the sweep dir
        watched(timeout=5)  # its own failure (a wait timed out) is raised here
        returns = sweep.returns[0]
        dirs = [Path(r.hydra_cfg.hydra.runtime.output_dir) for r in returns]
        metrics = {d.name: read_jsonl(d / "metrics.jsonl") for d in dirs}
        kept = [d.name for d in dirs if (d / "worker-0.preempted-1.log").exists()]
        table = (dirs[0].parent / "summary.txt").read_text()
    assert EVERY <= preempted["step"] < STEPS, "preempted mid-run"
    assert len(returns) == 3 and len(set(dirs)) == 3
    values = {d.name: r.return_value for d, r in zip(dirs, returns)}  # raises for a failed job
    assert all(v["step"] == STEPS and "loss" in v for v in values.values())
    requeued = values[preempted["run"]]
    assert requeued["vm"] == "vm-b" and requeued["preemptions"] == 1
    assert kept == [preempted["run"]]
    resumed = metrics[preempted["run"]][0]  # the re-run's first record: where it resumed
    assert resumed["preemptions"] == 1 and resumed["step"] >= EVERY and resumed["step"] % EVERY == 0
    assert all("preemptions" not in r for name, rows in metrics.items() if name != preempted["run"]
               for r in rows)
    rows = {line.split()[0]: line.split() for line in table.splitlines()[1:]}
    assert sorted(rows) == sorted(values)
    assert [rows[preempted["run"]][i] for i in (1, 3, 4)] == ["vm-b", "finished", "1"]
    assert all(row[3] == "finished" for row in rows.values())
    assert "fleet: TPU vm-a leaves the pool" in capsys.readouterr().out
