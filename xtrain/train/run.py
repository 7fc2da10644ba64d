"""Assemble a run from its resolved config groups and train it with Lightning's Trainer.

Each ``build_*`` step makes one part from its own config group; :func:`train` wires them.
"""

from __future__ import annotations

import logging
import os
import platform
from dataclasses import dataclass

from xtrain import compat
from xtrain.config import to_plain
from xtrain.engines.base import Engine
from xtrain.plan import RunPlan


def build_engine(cfg, plan: RunPlan, run_dir: str) -> Engine:
    hardware, trainer_cfg = cfg.hardware, cfg.trainer
    if hardware.engine == "xla":
        from xtrain.xla.engine import XLAEngine

        analysis = os.path.join(run_dir, "xla_compilations.log") if trainer_cfg.max_compiles else None
        return XLAEngine(hardware, cfg.parallelism, plan, compile_analysis=analysis,
                         compile_cache=cfg.compile_cache)
    from xtrain.engines.cpu import CPUEngine, compile_pays

    compile_step = trainer_cfg.compile
    return CPUEngine(plan, compile_pays(plan) if compile_step is None else compile_step)


@dataclass
class Loaders:
    train: object  # the PackedLoader (its position is checkpointed)
    steps: object  # optimizer-step batches for the Trainer
    val: object | None


def build_loaders(data, trainer_cfg, seq_len: int, tokenizer, rows: int, accum: int,
                  rank: int = 0, world: int = 1) -> Loaders:
    from xtrain.data.batches import EvalBatches, StepBatches
    from xtrain.data.loader import PackedLoader, list_shards

    train_files, val_files = data.train_files, data.val_files
    if data.holdout_last_shard:  # nanochat's convention: the last shard is the validation split
        shards = list_shards(data.train_files)  # at least 2 (xtrain.inputs.check_data)
        train_files, val_files = shards[:-1], shards[-1:]
    train = PackedLoader(train_files, tokenizer, seq_len, rows, seed=trainer_cfg.seed, rank=rank,
                         world=world, prefetch=data.prefetch, threads=data.tokenizer_threads)
    val = None
    if val_files:
        val_loader = PackedLoader(val_files, tokenizer, seq_len, rows, shuffle=False, loop=True,
                                  rank=rank, world=world, prefetch=2, threads=data.tokenizer_threads)
        val = EvalBatches(val_loader, trainer_cfg.eval_batches)
    return Loaders(train, StepBatches(train, accum, repeat=trainer_cfg.overfit_batches), val)


def build_sinks(cfg, plan: RunPlan, run_dir: str) -> list:
    from xtrain.observe.sinks import ConsoleSink, JsonlSink, WandbSink

    sinks = [JsonlSink(os.path.join(run_dir, "metrics.jsonl")), ConsoleSink(plan.max_steps)]
    if cfg.logging.wandb:
        log = cfg.logging
        sinks.append(WandbSink(log.wandb_project, log.wandb_entity, cfg.run.name, run_dir, to_plain(cfg)))
    return sinks


def run_meta(cfg) -> dict:
    """What every checkpoint records about the run that wrote it."""
    versions = compat.installed_versions(("torch", "lightning"))
    return {"config": to_plain(cfg), "python": platform.python_version(), **versions}


def build_profiler(trainer_cfg, run_dir: str):
    """Lightning's PyTorch profiler over three steps after two of warm-up (the first steps
    compile), as a chrome trace in the run dir; None when not asked for."""
    if not trainer_cfg.profile:
        return None
    import torch
    from lightning.pytorch.profilers import PyTorchProfiler

    return PyTorchProfiler(dirpath=run_dir, filename="profile", export_to_chrome=True,
                           schedule=torch.profiler.schedule(wait=0, warmup=2, active=3, repeat=1))


def build_trainer(engine: Engine, checkpoint_io, callbacks: list, plan: RunPlan, trainer_cfg,
                  has_val: bool, run_dir: str):
    import lightning as L

    compat.quiet_lightning_tpu_probe()
    eval_every = trainer_cfg.eval_every or plan.max_steps
    return L.Trainer(
        **engine.trainer_kwargs(checkpoint_io), max_steps=plan.max_steps, logger=False,
        enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False,
        num_sanity_val_steps=0, callbacks=callbacks + engine.callbacks(trainer_cfg, run_dir),
        profiler=build_profiler(trainer_cfg, run_dir), default_root_dir=run_dir,
        val_check_interval=eval_every if has_val else None,
        check_val_every_n_epoch=None, limit_val_batches=trainer_cfg.eval_batches,
    )


@dataclass
class Callbacks:
    metrics: object
    checkpointer: object
    stop: object
    checkpoint_io: object

    def all(self, loader_state) -> list:
        return [self.metrics, loader_state, self.checkpointer]


def build_callbacks(cfg, plan: RunPlan, run_dir: str, engine: Engine, ckpt_dir: str) -> Callbacks:
    from xtrain.observe.metrics import MetricsLogger
    from xtrain.train.checkpointing import PeriodicCheckpoint
    from xtrain.train.preemption import StopRequest

    metrics = MetricsLogger(build_sinks(cfg, plan, run_dir), cfg.trainer.log_every,
                            plan.batch.total_batch_size, plan.flops_per_token,
                            cfg.hardware.peak_bf16_tflops_per_chip * 1e12, plan.devices,
                            extra=engine.counters, fetch=engine.fetch)
    stop, ckpt = StopRequest(), cfg.checkpoint
    checkpoint_io = engine.checkpoint_io(ckpt.retries)
    checkpointer = PeriodicCheckpoint(ckpt_dir, ckpt.every, checkpoint_io, ckpt.keep_last,
                                      ckpt.keep_every, stop=stop, report=metrics.write,
                                      meta=run_meta(cfg))
    return Callbacks(metrics, checkpointer, stop, checkpoint_io)


def resume_point(ckpt, ckpt_dir: str, gpt) -> str | None:
    """The checkpoint to start from: ``checkpoint.resume``, else the newest committed one."""
    from xtrain.inputs import resume_checkpoint

    resume_from = resume_checkpoint(ckpt.resume, ckpt_dir, gpt)
    if resume_from:
        print(f"resuming from {resume_from}")
    return resume_from


def fit(trainer, module, loaders: Loaders, resume_from, callbacks: Callbacks) -> None:
    import torch
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    step_loader = torch.utils.data.DataLoader(loaders.steps, batch_size=None)
    val_loader = torch.utils.data.DataLoader(loaders.val, batch_size=None) if loaders.val else None
    callbacks.stop.install()
    try:
        trainer.fit(module, train_dataloaders=step_loader, val_dataloaders=val_loader,
                    ckpt_path=resume_from)
    except SIGTERMException:
        pass  # raised by the checkpoint callback after its save at the step boundary
    finally:
        callbacks.stop.uninstall()
        callbacks.metrics.close()


def train(cfg, plan: RunPlan, run_dir: str) -> dict:
    """Train; returns a summary (final step, newest checkpoint, preempted or not)."""
    import lightning as L

    from xtrain.checkpoint.layout import latest_checkpoint
    from xtrain.data import prepare
    from xtrain.inputs import checkpoint_dir
    from xtrain.train.loader_state import LoaderState
    from xtrain.train.module import GPTModule
    from xtrain.train.sampling import sample_text

    # Lightning's INFO banners (accelerator probes, tips) would also flow through Hydra's log
    # handler twice; xtrain prints its own plan and progress.
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    trainer_cfg = cfg.trainer
    ckpt_dir = checkpoint_dir(cfg, run_dir)  # checked writable by xtrain.inputs
    tokenizer = prepare(cfg.data)
    engine = build_engine(cfg, plan, run_dir)
    L.seed_everything(trainer_cfg.seed, verbose=False)
    loaders = build_loaders(cfg.data, trainer_cfg, plan.gpt.sequence_len, tokenizer,
                            rows=engine.rows_per_host, accum=plan.batch.grad_accum_steps,
                            rank=engine.rank, world=engine.world)
    module = GPTModule(plan.gpt, cfg.optim, plan.max_steps, precision=cfg.hardware.precision,
                       token_bytes=tokenizer.token_bytes)
    callbacks = build_callbacks(cfg, plan, run_dir, engine, ckpt_dir)
    trainer = build_trainer(engine, callbacks.checkpoint_io, callbacks.all(LoaderState(loaders.train)),
                            plan, trainer_cfg, loaders.val is not None, run_dir)
    fit(trainer, module, loaders, resume_point(cfg.checkpoint, ckpt_dir, plan.gpt), callbacks)
    newest = latest_checkpoint(ckpt_dir)
    if callbacks.checkpointer.preempted:
        saved = ("checkpoint committed" if callbacks.checkpointer.preemption_saved else
                 f"its checkpoint could not be written, the newest committed one is {newest}")
        print(f"stopped by a signal at step {trainer.global_step}: {saved}; run the same command "
              "to resume", flush=True)
        return {"step": trainer.global_step, "checkpoint": newest, "preempted": True}
    if trainer_cfg.sample_tokens > 0:
        print("sample:\n" + sample_text(module.model, tokenizer, trainer_cfg.sample_tokens, trainer_cfg.seed))
    return {"step": trainer.global_step, "checkpoint": newest, **engine.summary()}
