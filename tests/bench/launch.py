"""Launch overhead: the tiny job launched with ``hydra/launcher=tpu_vm`` on a loopback "VM" (a real
sshd, tests/sshd.py) vs the same job run locally, both through ``python -m xtrain``. The remote
launch is measured on an unchanged tree (its second launch: nothing to copy or install), which is
the relaunch case the launcher is built for."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.sshd import HOSTS, Remote, Sshd, stack_venv

COMMAND = "make bench ARGS=launch   (python -m tests.bench launch)"
ROOT = Path(__file__).resolve().parents[2]
JOB = ["model=d2", "model.sequence_len=64", "trainer.device_batch_size=4", "trainer.max_steps=10",
       "trainer.sample_tokens=0"]


def _xtrain(args, cwd, env) -> tuple[float, str]:
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "xtrain", *args], cwd=cwd, env=env,
                       capture_output=True, text=True, timeout=900)
    if r.returncode:
        raise RuntimeError(f"xtrain {' '.join(args)} failed:\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
    return time.perf_counter() - t0, r.stdout


def run() -> str:
    with tempfile.TemporaryDirectory(prefix="xtrain-bench-launch-") as tmp:
        base = Path(tmp)
        env = dict(os.environ, XTRAIN_CACHE=str(base / "cache"),
                   PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "launch")]))
        sshd = Sshd(base / "sshd").start()
        try:
            stack_venv(base / "remote" / "hosts" / HOSTS[0] / "venv")
            remote = Remote(base / "remote", sshd, str(base / "cache"))
            # every run is a new run (its own name): none of them resumes a finished one
            launch = ["-m", *JOB, *remote.overrides()]
            _xtrain([*launch, "run.name=warm-up"], base, env)  # copies the tree, builds the corpus
            local_runs, remote_runs, to_start = [], [], []
            for i in range(2):  # alternate; each side keeps its best (noise only adds time)
                local_runs.append(_xtrain([*JOB, f"run.name=local{i}"], base, env)[0])
                t0 = time.time()
                seconds, out = _xtrain([*launch, f"run.name=launched{i}"], base, env)
                remote_runs.append(seconds)
                starts = base / "remote" / "hosts" / HOSTS[0] / "jobs" / f"launched{i}" / "starts"
                to_start.append(float(starts.read_text().split()[-1]) - t0)
                synced = re.search(r"(\d+) file\(s\) synced, environment (\w+)", out).groups()
                assert synced == ("0", "unchanged"), synced
        finally:
            sshd.stop()
    local, launched = min(local_runs), min(remote_runs)
    runs = ", ".join(f"{a:.1f}/{b:.1f}" for a, b in zip(local_runs, remote_runs))
    return (f"## Launch overhead: tpu_vm on a loopback VM vs a local run\n\n"
            f"`{COMMAND}`: `python -m xtrain {' '.join(JOB)}`, run locally and with "
            "`-m hydra/launcher=tpu_vm` on a real sshd at 127.0.0.2 (second launch of an "
            "unchanged tree: 0 files synced, environment stamp unchanged); whole commands, each "
            "side alternating twice and keeping its best.\n\n"
            f"| run | wall time |\n| --- | --- |\n| local | {local:.1f} s |\n"
            f"| launched over ssh | {launched:.1f} s |\n\n"
            f"**overhead {launched - local:+.1f} s, ratio launched / local = {launched / local:.2f}**"
            f"; the remote `python -m xtrain` started {min(to_start):.1f} s after the launch "
            f"command was typed (runs local/launched s: {runs})\n")


if __name__ == "__main__":
    print(run())
