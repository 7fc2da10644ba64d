"""The class of ``hydra/sweeper=xtrain`` (conf/train.yaml's default): Hydra's basic sweeper, whose
check of a batch of jobs before launching them also runs xtrain's checks of each job's config.
Hydra instantiates plugins only from this namespace; the config node is registered by xtrain
itself (xtrain/config/), so a run composes where this package is not installed (a launched
job on a worker runs xtrain from its synced tree).
"""

from hydra._internal.core_plugins.basic_sweeper import BasicSweeper


class XtrainSweeper(BasicSweeper):
    def sweep(self, arguments):
        from xtrain.sweeps import SweepRecord

        # Hydra writes the sweep's record before the first batch is checked
        self.record = SweepRecord(self.config.hydra.sweep.dir)
        self.jobs_keep_dirs = None  # (known once the jobs are checked)
        try:
            return super().sweep(arguments)
        finally:  # (also when a job was refused: its exit passes through Hydra)
            self.record.restore_if_no_jobs(self.jobs_keep_dirs)  # plans and compiles keep none

    def validate_batch_is_legal(self, batch) -> None:
        # called before each batch is launched: the first call checks every batch of the sweep
        # (hydra.sweeper.max_batch_size may split it), the later ones only compose, as Hydra's
        if self.batch_index > 1:
            return super().validate_batch_is_legal(batch)
        from xtrain.sweeps import check_jobs

        with self.record.restored_if_refused():
            self.jobs_keep_dirs = check_jobs(self.hydra_context.config_loader, self.config,
                                             [job for jobs in self.overrides for job in jobs])
