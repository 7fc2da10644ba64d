"""``hydra/sweeper=xtrain`` (conf/train.yaml's default): Hydra's basic sweeper, whose check of a
batch of jobs before launching them also runs xtrain's checks of each job's config
(xtrain/sweeps.py). Thin for the same reason as tpu.py: Hydra imports it at every startup.
"""

# No `from __future__ import annotations`: see tpu.py.
from dataclasses import dataclass

from hydra._internal.core_plugins.basic_sweeper import BasicSweeper, BasicSweeperConf
from hydra.core.config_store import ConfigStore


@dataclass
class XtrainSweeperConf(BasicSweeperConf):
    _target_: str = "hydra_plugins.xtrain_launchers.sweeper.XtrainSweeper"


ConfigStore.instance().store(group="hydra/sweeper", name="xtrain", node=XtrainSweeperConf,
                             provider="xtrain")


class XtrainSweeper(BasicSweeper):
    def validate_batch_is_legal(self, batch) -> None:
        # a batch is the whole sweep unless hydra.sweeper.max_batch_size splits it
        from xtrain.sweeps import check_jobs

        check_jobs(self.hydra_context.config_loader, self.config, batch)
