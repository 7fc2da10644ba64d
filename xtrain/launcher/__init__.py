"""Run xtrain jobs on a TPU VM or on every worker of a pod, over SSH (``hydra/launcher=tpu_vm``
or ``tpu_pod``). launch/README.md describes what happens on the VM; the modules, one concern each:

    config.py   the launcher's fields      runner.py  every external command (ssh, rsync, gcloud)
    targets.py  which hosts (gcloud.py)    ssh.py     OpenSSH options, retries, host keys
    sync.py     code to the workers        env.py     the worker's venv (envcheck.py runs there)
    worker.py   a worker and its probe     job.py     start / follow / poll / stop a remote job
    secrets.py  secrets over stdin         logs.py    workers' logs, locally
    launch.py   the whole launch           hydra_jobs.py  single runs (cli) and sweeps (plugin)
    fleet.py    spot VMs: a preemption     vm.py      a VM's state, its recreation (gcloud)
                told apart, survived       pool.py    a multirun spread over a pool of VMs

This package must stay importable without Hydra or torch: envcheck.py runs inside a fresh venv.
"""

from __future__ import annotations

from xtrain.launcher.runner import LaunchError

PLUGIN_PREFIX = "hydra_plugins.xtrain_launchers."


def is_remote(launcher_cfg) -> bool:
    """True when ``hydra.launcher`` is one of xtrain's (tpu_vm, tpu_pod): a single run must then be
    launched on the workers, never trained on this machine."""
    return str(launcher_cfg.get("_target_", "")).startswith(PLUGIN_PREFIX)


def launch_from_hydra(cfg) -> dict:
    from xtrain.launcher.hydra_jobs import launch_from_hydra as launch

    return launch(cfg)


__all__ = ["LaunchError", "is_remote", "launch_from_hydra"]
