"""Assemble a run from its resolved config groups and train it with Lightning's Trainer.

Each ``build_*`` step makes one part from its own config group; :func:`train` wires them. On
several processes (hosts) every process runs all of it; process 0 alone writes metrics, logs,
samples and checkpoint metadata (``engine.processes`` is the one source of that decision).
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import platform
from dataclasses import dataclass

from xtrain import compat
from xtrain.config import to_plain
from xtrain.config.hydra_record import ACCEPTED, accept
from xtrain.engines.base import Engine
from xtrain.errors import Terminated
from xtrain.inputs import checkpoint_dir
from xtrain.observe.bundle import code_fingerprint
from xtrain.plan import RunPlan
from xtrain.train.finish import end_status, finish_end, stopped
from xtrain.train.loaders import Loaders, build_loaders

log = logging.getLogger(__name__)


def build_engine(cfg, plan: RunPlan, run_dir: str) -> Engine:
    hardware, trainer_cfg = cfg.hardware, cfg.trainer
    timeout_s = trainer_cfg.collective_timeout_s
    if hardware.engine == "xla":
        from xtrain.xla.engine import XLAEngine

        analysis = os.path.join(run_dir, "xla_compilations.log") if trainer_cfg.max_compiles else None
        return XLAEngine(hardware, cfg.parallelism, plan, timeout_s, compile_analysis=analysis,
                         compile_cache=cfg.compile_cache)
    from xtrain.engines.cpu import CPUEngine
    from xtrain.engines.torch_compile import compile_pays

    compile_step = trainer_cfg.compile
    return CPUEngine(hardware, plan, timeout_s, compile_pays(plan) if compile_step is None else compile_step)


def build_run_log(cfg, plan: RunPlan, run_dir: str, engine: Engine, start_step: int):
    """The run's loggers (rank 0), and its reproducibility bundle."""
    from xtrain.observe.bundle import write_bundle
    from xtrain.observe.loggers import build_run_log as build

    if engine.rank == 0:  # first: a failure here leaves no logger (a W&B run) open
        write_bundle(run_dir, start_step, to_plain(cfg), {"engine": engine.name, "mesh": plan.mesh,
                                                          "devices": engine.devices()})
    return build(cfg.logger, run_dir, cfg.run.name, to_plain(cfg), plan.max_steps, start_step,
                 engine.rank)


def run_meta(cfg, tokenizer_fingerprint: str | None = None, max_steps: int | None = None,
             total_batch_size: int | None = None) -> dict:
    """What every checkpoint records about the run that wrote it (the config's secrets masked,
    the tokenizer's fingerprint, the last step its learning-rate schedule led to, its tokens
    per step)."""
    from xtrain.observe.bundle import mask_secrets

    versions = compat.installed_versions(("torch", "lightning"))
    return {"config": mask_secrets(to_plain(cfg)), "tokenizer_sha256": tokenizer_fingerprint,
            "max_steps": max_steps, "total_batch_size": total_batch_size,
            "python": platform.python_version(), **versions}


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
                  val_batches: int, run_dir: str, catch_up):
    """``val_batches``: per evaluation (0: no validation split). ``catch_up``
    (xtrain/train/catch_up.py) goes last: every other ``on_train_start`` first."""
    import lightning as L

    compat.quiet_lightning_tpu_probe()
    eval_every = trainer_cfg.eval_every or plan.max_steps
    return L.Trainer(
        **engine.trainer_kwargs(checkpoint_io), max_steps=plan.max_steps, logger=False,
        enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False,
        num_sanity_val_steps=0, callbacks=[*callbacks, *engine.callbacks(trainer_cfg, run_dir), catch_up],
        profiler=build_profiler(trainer_cfg, run_dir), default_root_dir=run_dir,
        val_check_interval=eval_every if val_batches else None,
        check_val_every_n_epoch=None, limit_val_batches=val_batches,
        inference_mode=False,  # trainer.validate (xtrain/train/finish.py) as fit's validation: no_grad
    )


@dataclass
class Callbacks:
    metrics: object
    checkpointer: object
    sampler: object
    stop: object
    checkpoint_io: object
    cpp_eval: object | None = None  # only with eval.cpp_every > 0, on rank 0
    dump: object = None  # test-only (xtrain/train/debug_dump.py)

    def all(self, loader_state) -> list:
        # order matters: the metrics see the step before a checkpoint, a sample or an evaluation
        return [c for c in (self.metrics, loader_state, self.checkpointer, self.sampler,
                            self.cpp_eval, self.dump) if c]


def build_callbacks(cfg, plan: RunPlan, engine: Engine, ckpt_dir: str, run_dir: str, run_log,
                    tokenizer, lease=None) -> Callbacks:
    from xtrain.observe.metrics import MetricsLogger, PhaseTimer
    from xtrain.observe.peak import MEASURED, run_peak_flops
    from xtrain.train.checkpointing import PeriodicCheckpoint
    from xtrain.train.debug_dump import debug_dump
    from xtrain.train.preemption import StopRequest
    from xtrain.train.sampling import SampleCallback

    peak, source = run_peak_flops(cfg.hardware, plan.devices, engine.world) if engine.rank == 0 else (0.0, "")
    if source:
        log.info("MFU peak: %s", source)
    timer, trainer_cfg = PhaseTimer(), cfg.trainer
    metrics = MetricsLogger(run_log, trainer_cfg.log_every, plan.max_steps, plan.flops_per_token,
                            peak, plan.devices, timer=timer,
                            extra=engine.counters, fetch=engine.fetch, batch_shares=engine.batch_shares,
                            peak_measured=source.endswith(MEASURED))
    stop, ckpt = StopRequest(engine.processes), cfg.checkpoint
    checkpoint_io = engine.checkpoint_io(ckpt.retries)
    checkpoint_io.fence = lease.check if lease else None  # (the lease: process 0's)
    checkpointer = PeriodicCheckpoint(
        ckpt_dir, ckpt.every, checkpoint_io, ckpt.keep_last, ckpt.keep_every, stop=stop,
        report=lambda r: run_log.record("checkpoint", r["step"], {k: v for k, v in r.items() if k != "step"}),
        meta=run_meta(cfg, tokenizer.fingerprint, plan.max_steps, plan.batch.total_batch_size),
        timer=timer)
    sampler = SampleCallback(tokenizer, cfg.sample, trainer_cfg.sample_tokens, trainer_cfg.sample_every,
                             run_log, timer, stop=stop)
    cpp_eval = None
    if cfg.eval.cpp_every and engine.rank == 0:
        from xtrain.train.cpp_eval import CppEvalCallback

        # on more than one process, a host may hold only its shards: the step's checkpoint then
        cpp_eval = CppEvalCallback(cfg.eval, tokenizer, run_log, timer, run_dir, plan.gpt, ckpt_dir,
                                   from_checkpoints=engine.world > 1, stop=stop)
    return Callbacks(metrics, checkpointer, sampler, stop, checkpoint_io, cpp_eval,
                     debug_dump(engine.rank, engine.host_rows))


def resume_point(cfg, ckpt_dir: str, run_dir: str, tokenizer, steps, engine: Engine,
                 plan: RunPlan) -> tuple[str | None, int]:
    """The checkpoint to start from (``checkpoint.resume``, else the newest intact committed one,
    as process 0 sees it: every process must resume from the same step) and its step (0 for a
    fresh run). One trained with another tokenizer is refused: its token ids mean other text; so
    is one at a data position ``steps`` (the training batches) cannot continue from, and one
    behind the dir the run's last training saved to (the early check compared that dir with the
    newest commit here, unverified, which may have been passed over as corrupt).
    Commits in ``ckpt_dir`` past that step (corrupt ones passed over, or those a
    ``checkpoint.rewind`` goes back from) are renamed aside by process 0, never deleted."""
    from xtrain.checkpoint.layout import read_meta
    from xtrain.errors import warn
    from xtrain.inputs import check_checkpoints_not_elsewhere, check_same_tokenizer, resume_checkpoint
    from xtrain.train.changed_settings import warn_changed_settings
    from xtrain.train.checkpointing import set_aside_newer
    from xtrain.train.loader_state import check_saved_position

    ckpt, primary = cfg.checkpoint, engine.processes.primary

    def find() -> str | None:
        found = resume_checkpoint(ckpt.resume, ckpt_dir, plan.gpt, cfg.run.name, rewind=ckpt.rewind)
        if not ckpt.resume:
            check_checkpoints_not_elsewhere(run_dir, ckpt_dir, cfg.data.remote_timeout_s, found)
        return found

    # (verifying a large checkpoint's files can outlast trainer.collective_timeout_s)
    resume_from = engine.processes.broadcast(engine.processes.primary_first(
        "finding the checkpoint to resume from", find))
    if not resume_from:
        return None, 0
    meta = read_meta(resume_from)
    check_same_tokenizer(resume_from, meta, tokenizer.fingerprint)
    check_saved_position(resume_from, steps)
    step = int(meta.get("step") or 0)
    if primary:
        if ckpt.resume and resume_from != ckpt.resume:
            log.info("checkpoint.resume=%s started this run; its own checkpoints are newer",
                     ckpt.resume)
            if ckpt.rewind:
                warn(f"checkpoint.rewind=true: {ckpt_dir} already holds this command's own work "
                     f"since {ckpt.resume}, which it continues; to rewind again, move its newer "
                     "checkpoints away (or use another run.name)")
        log.info("resuming from %s", resume_from)
        warn_changed_settings(resume_from, meta, step, cfg, plan)
        set_aside_newer(step, ckpt_dir, "rewound" if resume_from == ckpt.resume else "corrupt")
    return resume_from, step


def fit(trainer, module, loaders: Loaders, resume_from, callbacks: Callbacks, preemption,
        held: contextlib.ExitStack) -> None:
    """Lightning's fit. GCE notices are watched from here until ``held`` (the run's) closes: a
    notice during the end's validation or C++ evaluation is a stop too."""
    import torch
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    from xtrain.train.notices import watch

    watcher = watch(preemption, callbacks.stop)  # None off GCE: no thread, no request
    if watcher:
        held.callback(watcher.stop)
    step_loader = torch.utils.data.DataLoader(loaders.steps, batch_size=None)
    val_loader = torch.utils.data.DataLoader(loaders.val, batch_size=None) if loaders.val else None
    compat.keep_signal_handlers(trainer)
    callbacks.stop.install()
    try:
        trainer.fit(module, train_dataloaders=step_loader, val_dataloaders=val_loader,
                    ckpt_path=resume_from)
    except SIGTERMException:
        pass  # raised by the checkpoint callback after its save at the step boundary
    if not callbacks.checkpointer.preempted:  # (the stop stays installed until train_on's end)
        callbacks.stop.past_last_step.set()


def write_plots(run_dir: str) -> None:
    """The run's charts; a chart that cannot be drawn costs a warning, never the finished run."""
    from xtrain.observe.plots import write_run_plots

    try:
        write_run_plots(run_dir)
    except Exception as e:  # noqa: BLE001
        log.warning("plots not written (%s: %s)", type(e).__name__, e)


def prepare_data(cfg, engine: Engine, sequence_len: int):
    """The corpus and tokenizer, built on first use: by process 0 first, then by the others
    (which find it built when they share its disk), never by two processes into one directory;
    refused unless every process holds the same tokenizer (hosts that build from their own
    disk's sources could differ), or when the prompts the training generates from do not fit
    ``sequence_len`` with it."""
    from xtrain.data import prepare
    from xtrain.train.sampling import check_prompts_room

    data = cfg.data
    tokenizer = engine.processes.primary_first("data preparation", lambda: prepare(data, log=log.info),
                                               then=lambda: prepare(data, log=lambda *_: None))
    engine.processes.check_same("tokenizer", {"sha256": tokenizer.fingerprint})
    check_prompts_room(cfg, tokenizer, sequence_len, engine.rank)
    return tokenizer


def train(cfg, plan: RunPlan, run_dir: str, record: str | None = None) -> dict:
    """Train; returns a summary (final step, newest checkpoint, preempted or not). ``record``:
    this command's .hydra record, held in ``run_dir`` until it is accepted, as training starts."""
    # the processes first (a missing peer or launch variable fails here), then the shared-storage
    # check, both before data preparation and the first compile
    engine = build_engine(cfg, plan, run_dir)
    try:
        return train_on(engine, cfg, plan, run_dir, record)
    finally:
        engine.processes.close()
        # the model and optimizer state stay on the devices after fit (xtrain/xla/lightning.py's
        # teardown) and the trainer and module refer to each other: freed now, for the next job
        # of a sweep in this process
        gc.collect()


@contextlib.contextmanager
def naming_lost_peers(engine: Engine):
    """While the processes work together (set-up, training), an error is re-raised as PeerLost
    naming the process that vanished, when one did: gloo's own error does not say which. Yields
    a function to call once their last collective is behind them: from then on a process that
    finished and left is no loss, and an error of this one's own (process 0's end of W&B, an
    upload of the run's log) is raised as itself."""
    from xtrain.errors import CheckpointNotWritten, InputError, PeerLost

    apart = []
    try:
        yield lambda: apart.append(True)
    except Exception as e:
        # (no wait for errors every process raises alike: the others may have left with theirs)
        if engine.world == 1 or apart or isinstance(e, (InputError, PeerLost, CheckpointNotWritten)):
            raise
        engine.processes.say_failed(e)  # (named by the others if this process is the one gone)
        lost = engine.processes.vanished()
        if not lost:
            raise
        raise PeerLost(f"lost {lost}; this is rank {engine.rank} ({type(e).__name__}: "
                       f"{str(e).splitlines()[0][:200]}). Run the same command to resume from "
                       "the newest committed checkpoint") from e


def say_if_nothing_to_train(resume_from: str | None, start_step: int, max_steps: int) -> None:
    if start_step == max_steps:  # a finished run, run again
        log.info("%s is at this run's last step %d (trainer.max_steps): nothing to train",
                 resume_from, start_step)
    elif start_step > max_steps:
        from xtrain.errors import warn

        warn(f"{resume_from} is at step {start_step}, past this run's last step {max_steps} "
             "(trainer.max_steps): nothing to train")


def train_on(engine: Engine, cfg, plan: RunPlan, run_dir: str, record: str | None) -> dict:
    import lightning as L

    from xtrain.checkpoint.layout import check_shared, latest_checkpoint
    from xtrain.train.catch_up import CatchUp
    from xtrain.train.loader_state import LoaderState
    from xtrain.train.module import GPTModule
    from xtrain.train.run_lock import checkpoint_dir_lease

    trainer_cfg = cfg.trainer
    ckpt_dir = checkpoint_dir(cfg, run_dir)  # checked writable by xtrain.inputs
    with naming_lost_peers(engine) as collectives_done, contextlib.ExitStack() as held:
        engine.processes.check_same("config", to_plain(cfg))
        engine.processes.check_same("code", code_fingerprint())
        check_shared(ckpt_dir, engine.processes)
        lease = held.enter_context(checkpoint_dir_lease(ckpt_dir, cfg, engine.processes))
        tokenizer = prepare_data(cfg, engine, plan.gpt.sequence_len)
        L.seed_everything(trainer_cfg.seed, verbose=False)
        loaders = build_loaders(cfg.data, trainer_cfg, plan.gpt.sequence_len, tokenizer,
                                rows=engine.global_rows, accum=plan.batch.grad_accum_steps,
                                host_rows=engine.host_rows)
        engine.processes.check_same("data", loaders.digests())
        module = GPTModule(plan.gpt, cfg.optim, plan.max_steps, precision=cfg.hardware.precision,
                           token_bytes=tokenizer.token_bytes)
        resume_from, start_step = resume_point(cfg, ckpt_dir, run_dir, tokenizer, loaders.steps,
                                               engine, plan)
        if engine.processes.primary:
            say_if_nothing_to_train(resume_from, start_step, plan.max_steps)
        run_log = build_run_log(cfg, plan, run_dir, engine, start_step)
        status = "failed"
        try:
            callbacks = build_callbacks(cfg, plan, engine, ckpt_dir, run_dir, run_log, tokenizer, lease)
            held.callback(callbacks.stop.uninstall)  # a stop during the end's work: end_status
            catch_up = CatchUp(start_step, run_dir, ckpt_dir, callbacks, engine.processes,
                               loaders.val is not None, trainer_cfg.eval_every or plan.max_steps)
            trainer = build_trainer(engine, callbacks.checkpoint_io,
                                    callbacks.all(LoaderState(loaders.steps)), plan, trainer_cfg,
                                    loaders.val.batches if loaders.val else 0, run_dir, catch_up)
            if record:  # every check passed: .hydra/ says what trains here
                accept(run_dir, record)
                log.info(ACCEPTED)  # a launcher accepts its local record at this line
            fit(trainer, module, loaders, resume_from, callbacks, cfg.preemption, held)
            finish_end(trainer, module, loaders.val, callbacks, run_dir, ckpt_dir, engine.processes,
                       cfg, start_step, plan.max_steps)
            callbacks.checkpointer.check_final_saved(trainer.global_step)
            status = end_status(callbacks, run_log, trainer.global_step, engine.processes)
            collectives_done()  # (the end's records and uploads are process 0's own)
        except Terminated:  # SIGTERM before training or after it (xtrain/train/preemption.py)
            status = "preempted"
            raise
        finally:
            run_log.close(status)
            if engine.rank == 0 and status != "failed":
                write_plots(run_dir)
    newest = latest_checkpoint(ckpt_dir)
    if status == "preempted":
        return stopped(callbacks, trainer.global_step, newest)
    if engine.name == "cpu":  # XLA would gather every shard onto every host for it
        log.info("param_checksum %s", param_checksum(module.model))
    return {"step": trainer.global_step, "checkpoint": newest, **engine.summary()}


def param_checksum(model) -> str:
    """A digest of the final parameters' bytes, printed by every process: the processes of a run
    hold replicas, so they print the same (tests/test_launch_e2e.py compares a pod run's hosts)."""
    import hashlib

    import torch

    digest = hashlib.blake2b(digest_size=8)
    for name, tensor in sorted(model.state_dict().items()):
        raw = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8)  # bf16 too
        digest.update(name.encode() + raw.numpy().tobytes())
    return digest.hexdigest()
