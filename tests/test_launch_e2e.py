"""The launchers end to end: `python -m xtrain -m ... hydra/launcher=tpu_vm|tpu_pod` trains the tiny
model on workers reached over real SSH (tests/sshd.py: sshd on 127.0.0.2 and 127.0.0.3, each host
with its own remote directory). Only gcloud is a stand-in (tests/sshd.py's FakeGcloud, first on
PATH: it replays TPU node JSON in gcloud's format and records its calls), because Google Cloud
cannot be reached from here."""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.sshd import (HOSTS, keygen, live_group, remote, sshd, gcloud,  # noqa: F401  (fixtures)
                        ssh_processes, tpu_node)
from tests.logreaders import wandb_runs
from xtrain.checkpoint.layout import committed_checkpoints
from xtrain.cli import config_dir
from xtrain.paths import PRIMARY_CONFIG
from xtrain.errors import EXIT_REFUSED

ROOT = Path(__file__).resolve().parent.parent
LAUNCH = ROOT / "launch"
if str(LAUNCH) not in sys.path:  # until the plugin is installed with the package
    sys.path.insert(0, str(LAUNCH))

TINY = ["model=d2", "model.sequence_len=64", "trainer.device_batch_size=4", "trainer.log_every=5",
        "trainer.sample_tokens=0"]


def xtrain_argv(*args, multirun=True) -> list[str]:
    return [sys.executable, "-m", "xtrain", *(["-m"] if multirun else []), *args]


def cli_env(extra=None) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(LAUNCH)]))
    env.pop("HYDRA_FULL_ERROR", None)
    env.update(extra or {})
    return env


def run_xtrain(*args, cwd, multirun=True, env=None, timeout=600) -> subprocess.CompletedProcess:
    return subprocess.run(xtrain_argv(*args, multirun=multirun), cwd=cwd, env=cli_env(env),
                          capture_output=True, text=True, timeout=timeout)


def start_xtrain(*args, cwd, env=None) -> subprocess.Popen:
    """A launch in the background, in its own process group (so the test can kill all of it)."""
    return subprocess.Popen(xtrain_argv(*args), cwd=cwd, env=cli_env(env), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def wait_for(predicate, timeout=120.0, what="condition"):
    deadline = time.time() + timeout
    while True:
        value = predicate()
        if value:
            return value
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def job_dir(remote, job: str, host=HOSTS[0]) -> Path:
    return remote.root(host) / "jobs" / job


def local_job_dir(cwd: Path, job: str, override: str = "") -> Path:
    """The launching command's Hydra job dir, multirun/<sweep>/<job>: the only one in ``cwd``
    whose sweep's record (multirun.yaml) holds ``override``."""
    (local,) = [d / job for d in (cwd / "multirun").iterdir()
                if (d / job).is_dir() and override in (d / "multirun.yaml").read_text()]
    return local


def job_pgid(remote, job: str, host=HOSTS[0]) -> int:
    """The remote job's process group, once it started (worker and test share this machine)."""
    pid = job_dir(remote, job, host) / "pid"
    return int(wait_for(lambda: pid.exists() and pid.read_text().strip(), what=f"{pid}"))


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_tpu_vm_trains_d2_remotely_and_returns_its_final_loss(remote, gcloud, hydra_sweep_runner,
                                                              tmp_path, monkeypatch):
    """Through Hydra's multirun and the plugin, in process, so the JobReturn itself is checked;
    the TPU name is resolved by (the stand-in) gcloud."""
    import hydra_plugins.xtrain_launchers.tpu  # noqa: F401  (registers hydra/launcher=tpu_vm)

    zone = "asia-northeast1-b"
    gcloud.add(tpu_node("my-v6e", zone, "v6e-4", [("10.146.0.5", HOSTS[0])]))
    monkeypatch.chdir(tmp_path)
    overrides = TINY + ["trainer.max_steps=10", "run.name=e2e-vm"] + remote.overrides(
        "tpu_vm", hosts=[], tpu="my-v6e", zone=zone)
    sweep = hydra_sweep_runner(calling_file=__file__, calling_module=None, task_function=None,
                               config_path=config_dir(), config_name=PRIMARY_CONFIG,
                               overrides=overrides, temp_dir=tmp_path / "multirun")
    with sweep:  # leaving it deletes the sweep dir
        (job_return,) = sweep.returns[0]
        local = Path(job_return.hydra_cfg.hydra.runtime.output_dir)
        log, local_metrics = (local / "worker-0.log").read_text(), read_jsonl(local / "metrics.jsonl")
    metrics = read_jsonl(remote.root(HOSTS[0]) / "runs" / "e2e-vm" / "metrics.jsonl")
    assert job_return.return_value["step"] == 10
    assert job_return.return_value["loss"] == [m for m in metrics if "loss" in m][-1]["loss"]
    assert ["compute", "tpus", "tpu-vm", "describe", "my-v6e", f"--zone={zone}",
            "--format=json"] in gcloud.calls()
    assert "step     10/10" in log and local_metrics == metrics
    # the worker ran with the coordinator's internal address in its environment
    assert "MASTER_ADDR=10.146.0.5" in (job_dir(remote, "e2e-vm") / "run.sh").read_text()


def test_a_launched_sweeps_jobs_log_to_its_wandb_group_and_start_over_on_a_new_vm(remote,
                                                                                 tmp_path):
    """The worker runs its job alone, outside the sweep: the group is resolved here and passed on.
    The W&B run id is the local job dir's. The same command on a VM that lost its disk (a
    recreated spot VM: no job or run dir there) finds no checkpoint there (the run dir on the VM
    held them): the launcher says that it trains from step 0 again, and gives it a new W&B run
    id (W&B would drop a resumed run's steps below the ones it has), in the same group. A job
    whose checkpoints are on GCS keeps its W&B run (tests/test_launch_fleet_e2e.py)."""
    args = TINY + ["trainer.max_steps=2", "run.name=e2e-group", "logger=[jsonl,wandb]",
                   "logger.wandb.mode=offline"] + remote.overrides()
    remote_run = remote.root(HOSTS[0]) / "runs" / "e2e-group"
    r = run_xtrain(*args, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    (run,) = wandb_runs(remote_run)
    local = local_job_dir(tmp_path, "e2e-group")
    sweep = local.parent.name
    assert "," in sweep and run["group"] == sweep  # its name, quoted on the worker's command line
    first = (local / "wandb-run-id").read_text()
    assert run["id"].startswith(f"{first}-")  # offline: each start is a W&B run named after it
    for gone in (remote_run, job_dir(remote, "e2e-group")):
        shutil.rmtree(gone)
    r = run_xtrain(*args, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert ("launch: warning: job e2e-group ran before on 127.0.0.2 (attempt " in r.stdout
            and "step 2 logged), and these workers hold no trace of it (a new VM's disk?): its "
            "checkpoints were in the run dir on that VM, so it trains from step 0 again, as a new "
            "W&B run" in r.stdout), r.stdout[-3000:]
    (again,) = wandb_runs(remote_run)
    second = (local / "wandb-run-id").read_text()
    assert second != first and (remote_run / "wandb-run-id").read_text() == second
    assert again["id"].startswith(f"{second}-") and again["group"] == run["group"]
    assert read_jsonl(remote_run / "metrics.jsonl")[0]["step"] == 1  # from step 0 again


def tree_snapshot(root: Path) -> dict:
    return {str(p.relative_to(root)): (p.stat().st_ino, p.stat().st_mtime_ns)
            for p in root.rglob("*") if p.is_file()}


def test_two_launches_at_once_start_the_job_once_and_an_unchanged_relaunch_copies_nothing(
        remote, tmp_path):
    """Two launches of one command at the same moment: the worker's launch lock (held here by
    the test first, so that both reach it) lets one place the job; the other waits, then finds
    it started and follows it. Each ends with the job's result. Then the same command again, the
    tree unchanged, copies and installs nothing."""
    args = TINY + ["trainer.max_steps=2", "run.name=e2e-again"] + remote.overrides()
    root = remote.root(HOSTS[0])
    root.mkdir(parents=True, exist_ok=True)
    launches = []
    with open(root / "launch.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        for name in ("a", "b"):
            (tmp_path / name).mkdir()
            out = open(tmp_path / f"{name}.out", "w")
            launches.append(subprocess.Popen(xtrain_argv(*args), cwd=tmp_path / name, env=cli_env(),
                                             stdout=out, stderr=subprocess.STDOUT, text=True))
        wait_for(lambda: all("is placing a job there: waiting for it" in
                             (tmp_path / f"{n}.out").read_text() for n in "ab"),
                 timeout=240, what="both launches at the lock")
    assert [p.wait(timeout=600) for p in launches] == [0, 0], [
        (tmp_path / f"{n}.out").read_text()[-3000:] for n in "ab"]
    outputs = [(tmp_path / f"{n}.out").read_text() for n in "ab"]
    reattached = [bool(re.search(r"^launch: job e2e-again \(attempt \S+\) is already on the "
                                 r"workers: reattaching$", o, re.M)) for o in outputs]
    assert sorted(reattached) == [False, True]
    for name in "ab":  # each command's .hydra record accepted once the worker's checks passed
        local = local_job_dir(tmp_path / name, "e2e-again")
        assert "run.name=e2e-again" in (local / ".hydra" / "overrides.yaml").read_text()
    assert len((job_dir(remote, "e2e-again") / "starts").read_text().splitlines()) == 1
    final = [json.loads((local_job_dir(tmp_path / n, "e2e-again") / "result.json").read_text())
             for n in "ab"]
    assert final[0]["loss"] == final[1]["loss"] and final[0]["step"] == 2
    # the worker's tree has no .git: its run records the commit of the checkout it came from
    (code,) = (root / "runs" / "e2e-again" / "repro").glob("*/code.json")
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True,
                          text=True, check=True).stdout.strip()
    facts = json.loads(code.read_text())
    assert facts["git"] and facts["commit"] == head and facts["root"] == str(ROOT)
    assert facts["synced_to"] == str(root / "code")
    code, venv = tree_snapshot(root / "code"), tree_snapshot(root / "venv")
    second = run_xtrain(*args, cwd=tmp_path / "a")
    assert second.returncode == 0, second.stderr[-3000:]
    assert "0 file(s) synced, environment unchanged" in second.stdout
    assert tree_snapshot(root / "code") == code and tree_snapshot(root / "venv") == venv


def test_a_failing_worker_stops_its_peer_and_its_error_reaches_the_console(remote, tmp_path):
    """A pod of two: worker 1 cannot create its run directory (a file is in the way), worker 0
    trains on; the launcher stops worker 0 and reports worker 1's error."""
    blocker = remote.root(HOSTS[1]) / "runs" / "e2e-fail"
    blocker.parent.mkdir(parents=True, exist_ok=True)
    blocker.write_text("in the way\n")
    args = TINY + ["hardware.hosts=2", "trainer.max_steps=100000", "run.name=e2e-fail"] + \
        remote.overrides("tpu_pod", hosts=list(HOSTS))
    r = run_xtrain(*args, cwd=tmp_path)
    assert r.returncode == 1
    assert f"worker 1 ({HOSTS[1]}) failed (exit code 1)" in r.stderr
    assert "FileExistsError" in r.stderr or "Not a directory" in r.stderr  # the worker's own error
    w0 = job_dir(remote, "e2e-fail", HOSTS[0])
    assert live_group(int((w0 / "pid").read_text())) == []  # the peer was stopped
    if (w0 / "exit").exists():
        assert (w0 / "exit").read_text().strip() == "143"  # it ended on the SIGTERM
    else:  # the grace ran out (seen under CI load) and SIGKILL took its wrapper too
        assert f"worker 0 ({HOSTS[0]}) did not stop within 10 s of SIGTERM: killed" in r.stdout
    assert "stopping the others" in r.stdout


def test_an_ssh_drop_leaves_the_run_going_and_a_relaunch_reattaches(remote, tmp_path):
    """Kill the local ssh client that streams the log: the remote run goes on, the launcher
    reattaches. Then kill the whole local launcher: the run goes on, the same command reattaches,
    and the job runs (and finishes) once."""
    args = TINY + ["trainer.max_steps=10", "run.name=e2e-drop"] + remote.overrides()
    job = job_dir(remote, "e2e-drop")
    first = start_xtrain(*args, cwd=tmp_path)
    pgid = None
    try:
        pgid = job_pgid(remote, "e2e-drop")
        os.killpg(pgid, signal.SIGSTOP)  # hold the job, so it is surely mid-run
        (client,) = wait_for(lambda: ssh_processes(f"{job}/log"), what="the log stream")
        os.kill(client, signal.SIGKILL)
        wait_for(lambda: ssh_processes(f"{job}/log") not in ([], [client]), what="a new stream")
        assert live_group(pgid)  # the remote run is still there
        os.killpg(first.pid, signal.SIGKILL)  # now the whole local side is gone
        first.wait(30)
        assert live_group(pgid)
        second = start_xtrain(*args, cwd=tmp_path)
        wait_for(lambda: ssh_processes(f"{job}/log"), what="the reattached stream")
        os.killpg(pgid, signal.SIGCONT)
        out, _ = second.communicate(timeout=300)
    finally:
        if pgid and live_group(pgid):
            os.killpg(pgid, signal.SIGCONT)
    assert second.returncode == 0, out[-3000:]
    assert "is already on the workers: reattaching" in out
    first_out = first.stdout.read()
    assert "log stream cut; the job is still running, reattaching" in first_out
    assert len((job / "starts").read_text().splitlines()) == 1  # started once
    log = (job / "log").read_text()
    assert log.count("step     10/10") == 1
    local = local_job_dir(tmp_path, "e2e-drop") / "worker-0.log"
    assert local.read_text() == log  # the local copy is whole, nothing twice
    # the reattaching command's record is accepted; the killed launch's held one is gone
    assert "run.name=e2e-drop" in (local.parent / ".hydra" / "overrides.yaml").read_text()
    assert not [p.name for p in local.parent.glob(".hydra-*")]


def test_stop_option_stops_the_job_which_checkpoints(remote, tmp_path):
    """`hydra.launcher.stop=true` SIGTERMs the running job: xtrain checkpoints and exits 143; the
    launcher following it reports the stop, and the next launch starts (and resumes) afresh."""
    args = TINY + ["trainer.max_steps=100000", "run.name=e2e-stop"] + remote.overrides()
    follower = start_xtrain(*args, cwd=tmp_path)
    log = job_dir(remote, "e2e-stop") / "log"
    try:
        wait_for(lambda: log.exists() and "step      5/" in log.read_text(), what="training")
        # the same run name, another command: refused, not attached to the running job
        other = run_xtrain(*[a.replace("100000", "99999") for a in args], cwd=tmp_path, timeout=120)
        stop = run_xtrain(*args, "hydra.launcher.stop=true", cwd=tmp_path)
        out, _ = follower.communicate(timeout=300)
    finally:
        if follower.poll() is None:
            os.killpg(follower.pid, signal.SIGKILL)
    assert other.returncode == EXIT_REFUSED, other.stderr[-2000:]
    assert "xtrain: config error: job e2e-stop is running on worker 0" in other.stderr
    assert "with other overrides than these" in other.stderr
    assert stop.returncode == 0 and "stopped job e2e-stop on 1 worker(s)" in stop.stdout
    assert follower.returncode == 143, out[-3000:]  # as a single run stopped
    assert "stopped at a signal (exit 143)" in out
    assert "1 job(s) of the sweep stopped before finishing (" in out
    local = local_job_dir(tmp_path, "e2e-stop", "trainer.max_steps=100000")  # the stop's too
    result = json.loads((local / "result.json").read_text())
    assert result["preempted"] is True
    # the run's stop record, from this attempt (its id reached the job), says why
    launched = json.loads((local / "launch.json").read_text())
    assert (result["stopped_for"], result["stop_reason"], result["attempt"]) == (
        "signal", "SIGTERM", launched["attempt"])
    assert list((remote.root(HOSTS[0]) / "runs" / "e2e-stop" / "checkpoints").glob("*/COMMITTED"))
    assert (job_dir(remote, "e2e-stop") / "reported").exists()
    # the refused command (another sweep: its own dir) gives its record back, unaccepted (a
    # sweep job's stays pending); the stop holds none
    assert "trainer.max_steps=100000" in (local / ".hydra" / "overrides.yaml").read_text()
    assert not list(local.glob(".hydra-held-*"))
    refused = local_job_dir(tmp_path, "e2e-stop", "trainer.max_steps=99999")
    assert not list(refused.glob(".hydra-held-*")) and not (refused / ".hydra").exists()
    assert "trainer.max_steps=99999" in (refused / ".hydra-pending" / "overrides.yaml").read_text()


def job_python(pgid: int) -> int:
    """The job's `python -m xtrain` process, once its wrapper started it."""
    def find():
        for pid in live_group(pgid):
            try:
                if b"\0-m\0xtrain\0" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    return pid
            except OSError:
                pass
    return wait_for(find, what="the job's python")


def test_secrets_reach_the_job_and_nothing_else(remote, tmp_path):
    """W&B runs (offline) with the forwarded key; the secrets are in the job's environment and in
    no file of the synced tree, the job and run dirs, the local job dir, the output or `ps`. The
    forwarded variable's name does not look secret (the bundle's env.json lists XTRAIN_*)."""
    secret, key = "xtrain-secret-" + os.urandom(8).hex(), "wandb-" + os.urandom(16).hex()
    args = TINY + ["trainer.max_steps=10", "run.name=e2e-secret", "logger=[jsonl,wandb]"] + \
        remote.overrides(secrets=["XTRAIN_TEST_PAT"],
                         env={"XTRAIN_CACHE": remote.cache, "WANDB_MODE": "offline"})
    proc = start_xtrain(*args, cwd=tmp_path, env={"XTRAIN_TEST_PAT": secret, "WANDB_API_KEY": key})
    python = job_python(job_pgid(remote, "e2e-secret"))
    environ = Path(f"/proc/{python}/environ").read_bytes().split(b"\0")
    assert f"XTRAIN_TEST_PAT={secret}".encode() in environ
    assert f"WANDB_API_KEY={key}".encode() in environ
    ps_outputs = [subprocess.run(argv, capture_output=True, text=True).stdout
                  for argv in (["ps", "auxww"], ["ps", "-eo", "pid,args"])]
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-3000:]
    assert all(re.search(rf"(^|\s){python}\s", out, re.M) for out in ps_outputs)  # the job is listed
    places = [remote.root(HOSTS[0]) / d for d in ("code", "jobs", "runs")] + [tmp_path]
    files = [p for place in places for p in place.rglob("*") if p.is_file()]
    assert len(files) > 50
    for text in [out, *ps_outputs] + [p.read_bytes().decode(errors="replace") for p in files]:
        assert secret not in text and key not in text


@pytest.mark.parametrize("case", ["host count", "identity file", "pod profile on tpu_vm",
                                  "unknown tpu", "changed host key"])
def test_bad_input_is_refused_before_anything_is_copied(remote, gcloud, tmp_path, case):
    fresh = tmp_path / "fresh"
    fields = {"remote_dir": str(fresh) + "/{host}", "known_hosts": str(tmp_path / "known_hosts")}
    hardware = []
    expected = None
    if case == "host count":
        fields.update(hosts=list(HOSTS))
        expected = "hydra.launcher.hosts has 2 host(s), hardware=cpu expects 1"
    elif case == "identity file":
        fields.update(identity_file=str(tmp_path / "missing_key"))
        expected = f"hydra.launcher.identity_file={tmp_path / 'missing_key'}: no such file"
    elif case == "pod profile on tpu_vm":
        hardware = ["hardware=v4_32"]
        expected = "hardware=v4_32 spans 4 hosts (a pod): use hydra/launcher=tpu_pod"
    elif case == "unknown tpu":
        fields.update(hosts=[], tpu="no-such-tpu", zone="us-central2-b")
        expected = ("gcloud could not describe TPU 'no-such-tpu' in us-central2-b: ERROR: "
                    "(gcloud.compute.tpus.tpu-vm.describe) NOT_FOUND")
    else:
        other = Path(f"{keygen(tmp_path / 'other_key')}.pub").read_text().split()
        (tmp_path / "known_hosts").write_text(f"[{HOSTS[0]}]:{remote.sshd.port} {other[0]} {other[1]}\n")
        expected = f"[{HOSTS[0]}]:{remote.sshd.port}: host key changed"
    r = run_xtrain(*TINY, *hardware, "run.name=e2e-bad", *remote.overrides(**fields), cwd=tmp_path)
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
    assert expected in r.stderr
    assert not fresh.exists()


def test_a_worker_busy_with_another_job_is_refused(remote, tmp_path):
    other = job_dir(remote, "e2e-other")
    other.mkdir(parents=True, exist_ok=True)
    sleeper = subprocess.Popen(["sleep", "120"], start_new_session=True)  # "another job"
    try:
        (other / "pid").write_text(f"{sleeper.pid}\n")
        r = run_xtrain(*TINY, "run.name=e2e-busy", *remote.overrides(), cwd=tmp_path)
    finally:
        sleeper.kill()
        sleeper.wait()
        (other / "pid").unlink()
    assert r.returncode == 1
    assert (f"another xtrain job is running there: worker 0 ({HOSTS[0]}): e2e-other pid "
            f"{sleeper.pid}") in r.stderr
    assert not job_dir(remote, "e2e-busy").exists()


def test_a_single_run_with_a_remote_launcher_runs_remotely(remote, tmp_path):
    """Without -m Hydra never calls a launcher; xtrain must still run the job remotely."""
    r = run_xtrain(*TINY, "trainer.max_steps=2", "run.name=e2e-single", *remote.overrides(),
                   cwd=tmp_path, multirun=False)
    assert r.returncode == 0, r.stderr[-3000:]
    assert read_jsonl(remote.root(HOSTS[0]) / "runs" / "e2e-single" / "metrics.jsonl")
    local = tmp_path / "outputs" / "e2e-single"
    assert (local / "worker-0.log").exists() and not (local / "checkpoints").exists()
    # the local record is this command's once its worker has passed the checks
    record = local / ".hydra" / "overrides.yaml"
    assert "trainer.max_steps=2" in record.read_text() and not (local / ".hydra-pending").exists()
    # a command the worker refuses (its model differs from the run's checkpoint, which only the
    # worker sees) leaves the local record of what trained there
    r = run_xtrain(*TINY, "model.depth=3", "trainer.max_steps=4", "run.name=e2e-single",
                   *remote.overrides(), cwd=tmp_path, multirun=False)
    assert r.returncode != 0 and "holds a different model" in r.stdout + r.stderr, r.stderr[-3000:]
    assert "launch: started" in r.stdout  # refused there, not here
    assert "trainer.max_steps=2" in record.read_text()
    assert "depth: 3" not in (local / ".hydra" / "config.yaml").read_text()


def test_a_two_host_pod_trains_over_both_hosts(remote, tmp_path):
    # the hosts share no disk except the checkpoint dir (on a pod: a bucket; here a directory both
    # loopback hosts see, since xtrain refuses a checkpoint dir a host cannot see)
    shared = tmp_path / "bucket" / "checkpoints"
    args = TINY + ["hardware.hosts=2", "trainer.max_steps=10", "run.name=e2e-pod",
                   f"checkpoint.dir={shared}"] + remote.overrides("tpu_pod", hosts=list(HOSTS))
    r = run_xtrain(*args, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    runs = [remote.root(h) / "runs" / "e2e-pod" for h in HOSTS]
    assert (runs[0] / "metrics.jsonl").exists() and not (runs[1] / "metrics.jsonl").exists()
    assert [step for step, _ in committed_checkpoints(str(shared))][-1] == 10
    logs = [(job_dir(remote, "e2e-pod", h) / "log").read_text() for h in HOSTS]
    # each rank prints a checksum of its final parameters (xtrain/train/run.py: param_checksum)
    sums = [[line for line in log.splitlines() if "param_checksum" in line][-1].split()[-1]
            for log in logs]
    assert sums[0] == sums[1] and len(sums[0]) == 16, sums
