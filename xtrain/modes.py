"""What ``python -m xtrain`` does with a composed config: resolve and check it (printing the plan),
then run its ``mode``. Heavy libraries are imported only by the modes that need them, so
``mode=plan`` stays fast and torch-free. Messages go through Python logging
(xtrain/observe/console.py); training and sampling also keep them in ``<run dir>/console.log``."""

from __future__ import annotations

import logging
import os

from xtrain.config import Engine, Mode, sample_prompts
from xtrain.config.hydra_record import SWEEP_RECORD, hold, released_on_error, writes_record
from xtrain.data import check_built_where_read
from xtrain.errors import ConfigError, warn
from xtrain.hardware import (check_fits_host, cpu_processes, launch_environment, run_devices,
                              run_processes)
from xtrain.inputs import check_inputs
from xtrain.observe.console import ConsoleLog
from xtrain.observe.loggers import check_logger_settings
from xtrain.plan import RunPlan, check_fits, check_ranges, resolve
from xtrain.train.preemption import sigterm_raises
from xtrain.train.run_lock import run_dir_lock

log = logging.getLogger(__name__)


def plan_run(cfg, where: str) -> RunPlan:
    """Resolve and check the config, and print the plan (also before a remote launch)."""
    plan = resolve(cfg, run_devices(cfg.hardware))
    log.info("run %s -> %s\n%s", cfg.run.name, where, plan.describe())
    return plan


def check_config(cfg) -> None:
    """The checks of ``cfg`` alone, nothing read or printed (a sweep runs them on every job before
    the first: xtrain/sweeps.py), and by :func:`run` before the run dir is taken."""
    if cfg.mode in (Mode.sample, Mode.eval):
        check_ranges(cfg)
    else:
        plan = resolve(cfg, run_devices(cfg.hardware))
        if cfg.mode == Mode.train:
            check_fits(plan, cfg)  # (mode=plan says whether it fits, then exits accordingly)
        if cfg.mode in TRAINING_PLANNED:
            check_built_where_read(cfg.data)
            check_logger_settings(cfg.logger)
            if cfg.checkpoint.rewind and not cfg.checkpoint.resume:  # (it would be passed over)
                raise ConfigError("checkpoint.rewind=true goes back to checkpoint.resume's step, "
                                  "which is not set: add checkpoint.resume=PATH")
    check_sampling(cfg)


# the modes whose checks are a training's: mode=plan answers whether that training would run
TRAINING_PLANNED = (Mode.train, Mode.plan)


def check_sampling(cfg) -> None:
    """What ranges cannot say of the ``sample`` and ``eval`` settings this command uses (the
    prompts of ``mode=sample``; the C++ evaluation's config, xtrain/evals/config.py, for
    ``mode=eval`` or training with ``eval.cpp_every``), before anything is read."""
    if cfg.mode == Mode.sample and not sample_prompts(cfg.sample):
        raise ConfigError("sample.prompts=[]: nothing to sample; give prompts (sample.prompts=[...] "
                          "or sample.prompt=...)")
    context = cfg.model.sequence_len
    generated = {  # tokens generated after a prompt in training, and how to have none
        "trainer.sample_tokens": (sample_prompts(cfg.sample) and cfg.trainer.sample_tokens,
                                  "0: no samples in training"),
        "eval.max_tokens": (cfg.eval.cpp_every and cfg.eval.max_tokens,
                            "null: the room each prompt leaves")}
    for key, (tokens, instead) in generated.items():  # a prompt holds BOS at least
        if cfg.mode in TRAINING_PLANNED and tokens and tokens >= context:
            raise ConfigError(f"{key}={tokens} leaves no room for a prompt in "
                              f"model.sequence_len={context}: lower it ({instead})")
    if cfg.mode == Mode.eval or (cfg.mode in TRAINING_PLANNED and cfg.eval.cpp_every):
        from xtrain.evals.config import check

        check(cfg.eval)


def run(cfg, run_dir: str) -> dict | None:
    """Resolve, check, print the plan, then dispatch on ``cfg.mode``. A training's first process
    takes the run dir first (xtrain/train/run_lock.py), then holds its .hydra record there
    (xtrain/config/hydra_record.py): a training refused for running beside another leaves that
    one's console.log and record alone."""
    check_config(cfg)  # the config alone, before the run dir is taken or anything written there
    check_environment(cfg)
    with sigterm_raises():
        if cfg.mode == Mode.train and writes_record():
            with run_dir_lock(run_dir):
                record = hold(run_dir)
                with released_on_error((run_dir, record)):
                    return run_checked(cfg, run_dir, record)
        return run_checked(cfg, run_dir, None)


def check_host_memory(cfg) -> None:
    """A training on this machine's memory (the CPU engine, or XLA on CPU) refused when its state
    cannot fit there (xtrain/hardware.py check_fits_host); a local sweep checks it for every job
    first."""
    if cfg.mode == Mode.train:
        fits_host(resolve(cfg, run_devices(cfg.hardware)))


def fits_host(plan: RunPlan) -> str | None:
    """check_fits_host of ``plan``: per device, times the devices of each process here."""
    return check_fits_host(plan.memory, plan.devices // plan.hosts)


def check_environment(cfg) -> None:
    """What a training needs of this process's environment, checked with the config (a launch
    checks it on the workers): the W&B key for online logging, the C++ evaluation's compiler and
    benchmark file, a multi-process CPU run's rendezvous variables (MASTER_ADDR, RANK, ...), and
    on the CPU engine the machine's memory for its state (xtrain/hardware.py check_fits_host)."""
    if cfg.mode != Mode.train:  # (mode=plan too: a TPU run is often planned on another machine)
        return
    check_host_memory(cfg)
    if cfg.logger.wandb is not None:
        from xtrain.observe.wandb_run import choose_mode

        choose_mode(cfg.logger.wandb.mode)  # online without a key is refused
    if cfg.eval.cpp_every:  # (the evaluation's own check compiles in its sandbox, later)
        from xtrain.evals.harness import find_gxx
        from xtrain.evals.problems import load_problems

        find_gxx(cfg.eval)
        load_problems(cfg.eval.cpp_file)  # read, not just found: a bad line is refused now too
    if cfg.hardware.engine == Engine.cpu and cpu_processes(cfg.hardware) > 1:
        launch_environment(cfg.hardware)
    elif run_processes(cfg.hardware) == 1 and not writes_record():
        # the run's one process would train without its run dir's lock and record (a RANK left
        # from another shell's torchrun, say)
        raise ConfigError(f"RANK={os.environ['RANK']!r} but hardware={cfg.hardware.name} runs one "
                          "process: unset RANK, or start the run's processes as its profile says")


def run_checked(cfg, run_dir: str, record: str | None) -> dict | None:
    if cfg.mode in (Mode.sample, Mode.eval):
        # the checkpoint's config decides the model, not this one: no plan (the ranges: run).
        # Found before console.log opens: a command refused for want of one leaves no log.
        path = checkpoint_to_read(cfg, run_dir)
        with ConsoleLog(run_dir):
            return (sample if cfg.mode == Mode.sample else evaluate)(cfg, run_dir, path)
    # console.log is process 0's (the others may share its run dir; their lines reach stdout)
    with ConsoleLog(run_dir if cfg.mode == Mode.train and writes_record() else None):
        plan = plan_run(cfg, run_dir)
        if cfg.mode == Mode.compile:
            return compile_for_tpu(cfg, plan)
        if cfg.mode == Mode.plan:
            return show_plan(cfg, plan)
        doubt = fits_host(plan)  # (what check_environment did not refuse)
        if doubt:
            warn(doubt)
        check_inputs(cfg, plan.gpt, run_dir)  # before data preparation, the model build or a compile
        from xtrain.train.run import train

        return train(cfg, plan, run_dir, record)


def compile_for_tpu(cfg, plan: RunPlan) -> None:
    """The TPU compiler, not the estimate, decides whether the step fits."""
    from xtrain.preflight.runner import preflight

    preflight(cfg, plan)


def show_plan(cfg, plan: RunPlan) -> None:
    if cfg.hardware.accelerator_type:
        from xtrain.preflight.cache import cached_report
        from xtrain.preflight.report import describe

        report = cached_report(cfg, plan)
        log.info(describe(report) if report else "TPU compiler: not run yet for this config (mode=compile)")
    check_fits(plan, cfg)
    hbm = cfg.hardware.hbm_gib_per_chip
    here = None if hbm else fits_host(plan) or "fits in this machine's memory"
    log.info("plan: " + (f"fits in {hbm:g} GiB HBM per chip" if hbm else here))


def checkpoint_to_read(cfg, run_dir: str) -> str:
    """``checkpoint.resume``, else the newest committed checkpoint of the run whose files match
    its manifest and hold every tensor it names (a damaged or incomplete newer one is warned
    about and passed over; one another run wrote is read, and said, as are newer ones the run's
    last training saved elsewhere); refused (with the path) when there is none, the one named
    is not committed or damaged, or either cannot be loaded safely (xtrain/checkpoint/io.py,
    check_loadable)."""
    from xtrain.checkpoint.io import check_loadable
    from xtrain.checkpoint.layout import run_of, step_of
    from xtrain.errors import InputError, StorageError
    from xtrain.inputs import (check_named_checkpoint, checkpoint_dir, newest_intact,
                               saved_elsewhere, saved_meta)

    if cfg.checkpoint.resume:
        check_named_checkpoint(cfg.checkpoint.resume)
        check_loadable(cfg.checkpoint.resume)  # before the tokenizer, the data or the model
        return cfg.checkpoint.resume
    directory, mode = checkpoint_dir(cfg, run_dir), f"mode={cfg.mode.value}"
    path = newest_intact(directory)  # checked as loadable on the way (missing_tensors)
    try:
        elsewhere = saved_elsewhere(run_dir, directory, cfg.data.remote_timeout_s,
                                    step_of(path) if path else -1)
    except StorageError:
        elsewhere = None  # (not answering: what is here is all that can be said)
    if path is not None:
        # said, not refused: the checkpoint decides the model, and a sweep's or another
        # profile's name may differ from its training's
        written_by = run_of(saved_meta(path), path)
        if written_by not in (None, cfg.run.name):
            warn(f"{mode} reads {path}, written by run {written_by} (not {cfg.run.name})")
        if elsewhere:
            warn(f"{mode} reads {path}, but the last training of this run saved newer "
                 f"checkpoints to {elsewhere[0]} (newest {elsewhere[1][-1]}): add "
                 f"checkpoint.dir={elsewhere[0]} to read them")
        return path
    in_sweep = os.path.exists(os.path.join(os.path.dirname(run_dir), SWEEP_RECORD))
    raise InputError(f"{mode}: no committed checkpoint in {directory} " + (
        f"(the last training of this run saved its checkpoints to {elsewhere[0]}, newest "
        f"{elsewhere[1][-1]}: add checkpoint.dir={elsewhere[0]})" if elsewhere else
        "(a sweep's job reads the checkpoints of its own dir, and a sweep's mode and sample "
        "settings are in its dirs' names: a sweep of this mode does not find a training "
        "sweep's checkpoints; give each job checkpoint.resume=PATH, such as multirun/"
        "<training sweep>/<job>/checkpoints/step_N)" if in_sweep and not cfg.checkpoint.dir
        else "(train this run first, or set checkpoint.resume=PATH)"))


def checkpoint_inputs(cfg, path: str):
    """A checkpoint's saved config (which decides the model and tokenizer, not this run's), its
    tokenizer (the one it was trained with, found, never built: xtrain/inputs.py
    checkpoint_tokenizer) and its step."""
    from xtrain.checkpoint.layout import saved_config
    from xtrain.data import checked_tokenizer
    from xtrain.inputs import checkpoint_tokenizer, saved_meta
    from xtrain.model.config import GPTConfig

    meta = saved_meta(path)
    saved = saved_config(meta, path)
    GPTConfig.from_checkpoint(path, saved)  # (refused here, naming the checkpoint)
    say_model_not_used(cfg, saved.model)
    directory = checkpoint_tokenizer(path, meta, cfg.data.tokenizer)
    return saved, checked_tokenizer(saved.data, directory), int(meta.get("step") or 0)


# The model fields that decide the network a checkpoint holds (the others choose how it runs)
ARCHITECTURE = ("depth", "aspect_ratio", "head_dim", "n_kv_head", "vocab_size", "sequence_len",
                "window_pattern", "window_len", "softcap")


def say_model_not_used(cfg, saved_model) -> None:
    """Warn when the model this command gives (a ``model=`` group or ``model.*`` fields) describes
    another network than the checkpoint's, which is the one run."""
    from omegaconf import OmegaConf

    from xtrain.model.config import GPTConfig

    given = {k: cfg.model[k] for k in model_keys_given() if cfg.model[k] is not None}
    try:
        network = GPTConfig.from_model(saved_model, "sdpa")
    except ConfigError:
        return  # (refused where the model is built, naming what is wrong)
    try:  # compared as networks: n_kv_head unset is n_kv_head = n_head
        same = GPTConfig.from_model(OmegaConf.merge(saved_model, given), "sdpa") == network
    except ConfigError:  # (what is given does not make a network with the checkpoint's rest)
        same = False
    if not same:
        saved = {k: saved_model.get(k) for k in given}
        differ = [f"model.{k}={v} (the checkpoint's: {'unset' if saved[k] is None else saved[k]})"
                  for k, v in given.items() if v != saved[k]]
        warn(f"mode={cfg.mode.value} runs the checkpoint's model; the one this command gives "
             "differs and is not used: " + ", ".join(differ))


def model_keys_given() -> list[str]:
    """The architecture fields the command sets: all of them for a ``model=`` group (or for a
    config composed without Hydra's command line), else those of its ``model.*`` overrides."""
    from hydra.core.hydra_config import HydraConfig

    from xtrain.naming import override_pairs

    if not HydraConfig.initialized():
        return list(ARCHITECTURE)
    keys = override_pairs(HydraConfig.get().overrides.task)
    if "model" in keys:
        return list(ARCHITECTURE)
    return [k for k in ARCHITECTURE if f"model.{k}" in keys]


def checkpoint_model(path: str, saved):
    """The GPT of a checkpoint on the CPU: its saved model config, its weights read without the
    optimizer state; refused when they disagree (a meta.json edited, or from another checkpoint)."""
    from xtrain.checkpoint.io import read_model_weights
    from xtrain.errors import CheckpointError
    from xtrain.model.config import GPTConfig
    from xtrain.model.gpt import GPT

    weights = read_model_weights(path)  # (a storage error is no disagreement: outside the try)
    try:
        return GPT.from_weights(GPTConfig.from_model(saved.model), weights)
    except RuntimeError as e:  # load_state_dict's: every missing, unexpected or mis-shaped tensor
        lines = [line.strip() for line in str(e).splitlines()[1:] if line.strip()]
        first = (lines or [str(e)])[0].replace("torch.Size([", "(").replace("])", ")")[:300]
        raise CheckpointError(f"checkpoint {path}: its tensors do not fit the model its meta.json "
                              f"describes ({first}): not a checkpoint to load; was meta.json edited, "
                              "or copied from another checkpoint?") from e


def sample(cfg, run_dir: str, path: str) -> dict:
    """Print completions of ``sample.prompt(s)`` from the checkpoint at ``path``."""
    from xtrain.model.generate import check_prompts_fit, generate

    s, stats = cfg.sample, {}
    prompts = sample_prompts(s)  # not empty (check_sampling)

    saved, tokenizer, _ = checkpoint_inputs(cfg, path)
    check_prompts_fit(tokenizer, prompts, s.max_tokens, saved.model.sequence_len, "sample.max_tokens")
    model = checkpoint_model(path, saved)
    log.info("sampling %s: %d x %d tokens per prompt, temperature %g, top_k %s, seed %d",
             path, s.n, s.max_tokens, s.temperature, s.top_k, s.seed)
    texts = generate(model, tokenizer, prompts, s.n, max_tokens=s.max_tokens,
                     temperature=s.temperature, top_k=s.top_k, seed=s.seed, stats=stats)
    for prompt, completions in zip(prompts, texts):
        for i, text in enumerate(completions):
            log.info("--- prompt %r, sample %d\n%s%s", prompt, i + 1, prompt, text)
    tok_per_s = stats["tokens"] / max(stats["seconds"], 1e-9)
    log.info("%d tokens in %.2f s: %.1f tok/s (KV cache, CPU)", stats["tokens"], stats["seconds"], tok_per_s)
    return {"checkpoint": path, "texts": texts, "tok_per_s": tok_per_s}


def evaluate(cfg, run_dir: str, path: str) -> dict:
    """Score the checkpoint at ``path`` on the C++ benchmark (``eval`` config); print the scores
    and write one record per sample to ``<run dir>/cpp_eval/step_N-eval-<time>-<random>.jsonl`` (beside
    training's ``step_N.jsonl``, which its metrics.jsonl record scored)."""
    from xtrain.evals import prepare
    from xtrain.evals.completions import check_fit, evaluate_model, records_path

    saved, tokenizer, step = checkpoint_inputs(cfg, path)
    problems = prepare(cfg.eval)  # the config, the benchmark file and the compiler, checked
    check_fit(tokenizer, problems, cfg.eval, saved.model.sequence_len)
    model = checkpoint_model(path, saved)
    records = records_path(run_dir, step, later=True)
    log.info("evaluating %s on %d C++ problems x %d samples", path, len(problems), cfg.eval.n)
    scores = evaluate_model(model, tokenizer, problems, cfg.eval, records)
    log.info("C++ scores at step %d:\n%s\nrecords: %s", step,
             "\n".join(f"  {k}: {v:.4g}" for k, v in scores.items()), records)
    return {"checkpoint": path, "step": step, "scores": scores, "records": records}
