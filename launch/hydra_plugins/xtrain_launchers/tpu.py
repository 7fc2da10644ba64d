"""``hydra/launcher=tpu_vm`` (one TPU VM) and ``tpu_pod`` (every worker of a pod slice).

Thin on purpose: Hydra imports every plugin module at startup, so this module holds only the
config nodes and a Launcher that delegates to xtrain/launcher/ when a sweep is launched. The
fields are documented once, in xtrain/launcher/config.py. Hydra calls a Launcher only in multirun
mode (``-m``); a single run with one of these launchers is routed by xtrain/cli.py.
"""

# No `from __future__ import annotations`: Hydra's plugin scan runs this module without entering
# it in sys.modules, where dataclasses would look up string annotations.
from dataclasses import dataclass

from hydra.core.config_store import ConfigStore
from hydra.plugins.launcher import Launcher

from xtrain.launcher.config import LauncherConfig

TARGET = "hydra_plugins.xtrain_launchers.tpu.XtrainLauncher"


@dataclass
class TpuVmLauncherConf(LauncherConfig):
    _target_: str = TARGET
    kind: str = "vm"


@dataclass
class TpuPodLauncherConf(LauncherConfig):
    _target_: str = TARGET
    kind: str = "pod"


ConfigStore.instance().store(group="hydra/launcher", name="tpu_vm", node=TpuVmLauncherConf,
                             provider="xtrain")
ConfigStore.instance().store(group="hydra/launcher", name="tpu_pod", node=TpuPodLauncherConf,
                             provider="xtrain")


class XtrainLauncher(Launcher):
    def __init__(self, **fields) -> None:  # Hydra passes the fields; each job reads its own copy
        super().__init__()
        self.hydra_context = self.config = None

    def setup(self, *, hydra_context, task_function, config) -> None:
        # task_function (local training) is not used: every job runs on the workers instead
        self.hydra_context, self.config = hydra_context, config

    def launch(self, job_overrides, initial_job_idx):
        from xtrain.launcher.hydra_jobs import launch_sweep

        return launch_sweep(self.hydra_context, self.config, job_overrides, initial_job_idx)
