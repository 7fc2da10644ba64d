"""Assemble a run from its resolved config groups and train it with Lightning's Trainer."""

from __future__ import annotations

import json
import logging
import os
import platform

from omegaconf import OmegaConf

from xtrain.plan import RunPlan, gpt_config


def versions() -> dict:
    import lightning
    import torch

    return {"python": platform.python_version(), "torch": str(torch.__version__),
            "lightning": str(lightning.__version__)}


def make_loaders(cfg, tokenizer, rows: int, accum: int, rank: int = 0, world: int = 1):
    from xtrain.data import DataError
    from xtrain.data.batches import EvalBatches, StepBatches
    from xtrain.data.loader import PackedLoader, list_shards

    data, seq = cfg.data, cfg.model.sequence_len
    train_files, val_files = data.train_files, data.val_files
    if data.holdout_last_shard:  # nanochat's convention: the last shard is the validation split
        shards = list_shards(data.train_files)
        if len(shards) < 2:
            raise DataError(f"{data.train_files}: holdout_last_shard needs at least 2 shards")
        train_files, val_files = shards[:-1], shards[-1:]
    train = PackedLoader(train_files, tokenizer, seq, rows, seed=cfg.trainer.seed, rank=rank,
                         world=world, prefetch=data.prefetch, threads=data.tokenizer_threads)
    val = None
    if val_files:
        val_loader = PackedLoader(val_files, tokenizer, seq, rows, shuffle=False, loop=True,
                                  rank=rank, world=world, prefetch=2, threads=data.tokenizer_threads)
        val = EvalBatches(val_loader, cfg.trainer.eval_batches)
    return train, StepBatches(train, accum), val


def train(cfg, plan: RunPlan, run_dir: str) -> dict:
    """Train; returns a summary (final step, newest checkpoint, preempted or not)."""
    import lightning as L
    import torch
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    from xtrain.checkpoint import (PeriodicCheckpoint, StopRequest, check_compatible, check_writable,
                                   latest_checkpoint)
    from xtrain.data import prepare
    from xtrain.data.batches import LoaderState
    from xtrain.hardware import quiet_lightning_tpu_probe
    from xtrain.observe.metrics import MetricsLogger
    from xtrain.plan import model_shape
    from xtrain.train.module import GPTModule

    # Lightning's INFO banners (accelerator probes, tips) would also flow through Hydra's log
    # handler twice; xtrain prints its own plan and progress.
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    trainer_cfg = cfg.trainer
    ckpt_dir = cfg.checkpoint.dir or os.path.join(run_dir, "checkpoints")
    check_writable(ckpt_dir)  # before data preparation and the first compile
    tokenizer = prepare(cfg.data)
    engine = Engine(cfg, plan)
    L.seed_everything(trainer_cfg.seed, verbose=False)
    train_loader, step_batches, val_batches = make_loaders(
        cfg, tokenizer, rows=engine.rows_per_host, accum=plan.batch.grad_accum_steps,
        rank=engine.rank, world=engine.world)
    module = GPTModule(gpt_config(cfg.model, plan.attention), cfg.optim, plan.max_steps,
                       precision=cfg.hardware.precision, token_bytes=tokenizer.token_bytes)

    wandb_run = _start_wandb(cfg, run_dir) if cfg.logging.wandb else None
    metrics = MetricsLogger(os.path.join(run_dir, "metrics.jsonl"), trainer_cfg.log_every,
                            plan.batch.total_batch_size, plan.flops_per_token,
                            cfg.hardware.peak_bf16_tflops_per_chip * 1e12, plan.devices, wandb_run,
                            extra=engine.counters, fetch=engine.fetch)
    stop = StopRequest()
    ckpt = cfg.checkpoint
    checkpoint_io = engine.checkpoint_io(ckpt.retries)
    checkpointer = PeriodicCheckpoint(
        ckpt_dir, ckpt.every, checkpoint_io, ckpt.keep_last, ckpt.keep_every, stop=stop,
        report=metrics.write, meta={"config": OmegaConf.to_container(cfg, resolve=True), **versions()})
    callbacks = [metrics, LoaderState(train_loader), checkpointer]
    eval_every = trainer_cfg.eval_every or plan.max_steps
    quiet_lightning_tpu_probe()
    trainer = L.Trainer(
        **engine.trainer_kwargs(checkpoint_io), max_steps=plan.max_steps, logger=False,
        enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False,
        num_sanity_val_steps=0, callbacks=callbacks,
        val_check_interval=eval_every if val_batches is not None else None,
        check_val_every_n_epoch=None, limit_val_batches=trainer_cfg.eval_batches,
    )
    resume_from = ckpt.resume or latest_checkpoint(ckpt_dir)
    if resume_from:
        check_compatible(resume_from, model_shape(cfg.model))
        print(f"resuming from {resume_from}")
    loader = torch.utils.data.DataLoader(step_batches, batch_size=None)
    val_loader = torch.utils.data.DataLoader(val_batches, batch_size=None) if val_batches else None
    stop.install()
    try:
        trainer.fit(module, train_dataloaders=loader, val_dataloaders=val_loader, ckpt_path=resume_from)
    except SIGTERMException:
        pass  # raised by the checkpoint callback after its save at the step boundary
    finally:
        stop.uninstall()
    if wandb_run is not None:
        wandb_run.finish()
    if checkpointer.preempted:
        newest = latest_checkpoint(ckpt_dir)
        saved = ("checkpoint committed" if checkpointer.preemption_saved else
                 f"its checkpoint could not be written, the newest committed one is {newest}")
        print(f"stopped by a signal at step {trainer.global_step}: {saved}; run the same command "
              "to resume", flush=True)
        return {"step": trainer.global_step, "checkpoint": newest, "preempted": True}
    if trainer_cfg.sample_tokens > 0:
        print("sample:\n" + sample_text(module.model, tokenizer, trainer_cfg.sample_tokens, trainer_cfg.seed))
    summary = {"step": trainer.global_step, "checkpoint": latest_checkpoint(ckpt_dir)}
    summary.update(engine.describe_sharding())
    return summary


class Engine:
    """What differs between the engines, in one place: the Trainer's device plugins, this host's
    share of the batch, and engine counters for the metrics."""

    def __init__(self, cfg, plan: RunPlan):
        self.kind = cfg.hardware.engine
        self.rank, self.world = 0, 1
        # rows of one micro-batch for the whole run: device batch x batch-parallel devices
        global_rows = cfg.trainer.device_batch_size * plan.batch.data_parallel
        if self.kind == "xla":
            from xtrain.xla.spmd import build_mesh, start_runtime

            start_runtime(cfg.hardware)
            import torch_xla.runtime as xr

            self.rank, self.world = xr.process_index(), xr.process_count()
            self.mesh = build_mesh(plan.mesh)
            self.rules = cfg.parallelism.rules
        self.rows_per_host = global_rows // self.world

    def checkpoint_io(self, retries: int):
        from xtrain.checkpoint import FsspecCheckpointIO

        if self.kind == "xla":  # every host writes and reads its own shards
            import torch.distributed as dist

            group = dist.group.WORLD if dist.is_initialized() else None
            return FsspecCheckpointIO(retries=retries, sharded=True, rank=self.rank, process_group=group)
        return FsspecCheckpointIO(retries=retries)

    def trainer_kwargs(self, checkpoint_io) -> dict:
        if self.kind == "xla":
            from xtrain.xla.lightning import SPMDStrategy

            self.strategy = SPMDStrategy(self.mesh, self.rules, checkpoint_io=checkpoint_io)
            return {"strategy": self.strategy, "devices": 1}
        return {"accelerator": "cpu", "devices": 1, "plugins": [checkpoint_io]}

    def fetch(self, tensors) -> list[float]:
        """Device tensors to Python floats in one device-to-host transfer."""
        if self.kind == "xla":
            import torch_xla.core.xla_model as xm

            return [float(t) for t in xm._maybe_convert_to_cpu(list(tensors))]
        return [float(t) for t in tensors]

    def describe_sharding(self) -> dict:
        """name -> the HLO sharding XLA held for each parameter (xla engine only)."""
        if self.kind != "xla":
            return {}
        return {"param_shardings": self.strategy.param_shardings}

    def counters(self) -> dict:
        if self.kind == "xla":
            from xtrain.xla.spmd import counters

            return counters()
        return {}


def sample_text(model, tokenizer, n_tokens: int, seed: int, prompt: str = "#include <") -> str:
    import torch

    if next(model.parameters()).device.type == "xla":  # token-by-token shapes would recompile
        from xtrain.model.gpt import GPT

        cpu_model = GPT(model.config)
        cpu_model.load_state_dict({k: v.cpu() for k, v in model.state_dict().items()})
        model = cpu_model
    model.eval()
    device = next(model.parameters()).device
    idx = torch.tensor([[tokenizer.bos_id] + tokenizer.encode(prompt)], device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    out = model.generate(idx, n_tokens, temperature=0.8, generator=gen)
    return tokenizer.decode(out[0, 1:].tolist())


def _start_wandb(cfg, run_dir: str):
    """W&B reads its key from WANDB_API_KEY; the config never holds it, so no secret is logged."""
    import wandb

    safe_id = "".join(c if c.isalnum() or c in "-_." else "_" for c in cfg.run.name)[:128]
    return wandb.init(project=cfg.logging.wandb_project, entity=cfg.logging.wandb_entity,
                      name=cfg.run.name, id=safe_id, resume="allow", dir=run_dir,
                      config=json.loads(json.dumps(OmegaConf.to_container(cfg, resolve=True))))
