"""Checks of what a run reads and writes, before data preparation, the model build or a compile:
the machine (a TPU profile needs that TPU), the checkpoint to resume from (committed, same model),
the checkpoint directory (writable), the tokenizer and the data shards. Each refusal names the
path and what is wrong with it. Remote (gs://) locations are asked within
``data.remote_timeout_s`` and named when they do not answer. Torch-free: a refusal comes within
about a second of the start.
"""

from __future__ import annotations

import os

from xtrain import compat
from xtrain.checkpoint import manifest
from xtrain.checkpoint.layout import (COMMIT_MARKER, check_writable, committed_checkpoints,
                                      latest_checkpoint, newer_commits, read_meta, run_of,
                                      saved_config, step_of)
from xtrain.config.hydra_record import RECORD
from xtrain.deadline import answered, within
from xtrain.errors import CheckpointError, ConfigError, DataError, EnvironmentMismatch, StorageError, warn
from xtrain.hardware import compile_cache_enabled, run_processes
from xtrain.model.config import GPTConfig
from xtrain.paths import is_local, location, url_to_fs


def checkpoint_dir(cfg, run_dir: str) -> str:
    return cfg.checkpoint.dir or os.path.join(run_dir, "checkpoints")


def check_host(hw) -> None:
    """A TPU profile trains only where that TPU is attached (no silent CPU run, and no minutes
    of libtpu asking a metadata server that is not there)."""
    if not hw.accelerator_type:
        return
    found = compat.tpu_chips_on_pci()
    if found == 0:
        raise EnvironmentMismatch(
            f"hardware={hw.name} trains on a {hw.accelerator_type} TPU, and this machine has no TPU "
            "chip on its PCI bus: run it on the TPU VM (hydra/launcher=tpu_vm or tpu_pod), or use "
            "mode=plan / mode=compile here")
    if found != hw.chips_per_host:
        raise EnvironmentMismatch(
            f"hardware={hw.name} expects {hw.chips_per_host} TPU chips per host, this machine has "
            f"{found}: pick the profile of this VM")


def saved_meta(path: str) -> dict:
    """A checkpoint's meta.json, read once for the checks below; refused when unreadable."""
    try:
        return read_meta(path)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: unreadable meta.json ({type(e).__name__}: {e})") from e


def check_compatible(path: str, gpt: GPTConfig, meta: dict, named: bool = False) -> None:
    """Refuse a checkpoint whose model (in its ``meta``, see :func:`saved_meta`) differs in
    shape from the configured one; ``named``: by ``checkpoint.resume`` (the advice differs)."""
    diff = gpt.differences(GPTConfig.from_checkpoint(path, saved_config(meta, path)))
    if diff and named:
        raise ConfigError(f"checkpoint.resume={path} holds a different model ({', '.join(diff)}): "
                          "give the model it was trained with, or a checkpoint of this model")
    if diff:
        raise ConfigError(f"checkpoint {path} holds a different model ({', '.join(diff)}); "
                          "start a new run (run.name=...) or restore the model config")


def resume_checkpoint(resume: str | None, ckpt_dir: str, gpt: GPTConfig, run_name: str | None = None,
                      early: bool = False, rewind: bool = False, seed: int | None = None) -> str | None:
    """The checkpoint a run starts from: ``checkpoint.resume`` (which must be one committed
    checkpoint whose files match its manifest and, unless ``rewind``, not older than a commit in
    ``ckpt_dir``; it gives way to commits a run started from it wrote there: the same command
    run again continues its own work), else the newest such one in ``ckpt_dir`` holding every
    tensor it names (newer corrupt or incomplete ones warned about and passed over), else None;
    checked against the configured model. Each checkpoint's checksums are read once: by the
    ``early`` call (:func:`check_inputs`) for ``checkpoint.resume``, so a bad one is refused
    before any work (and one that cannot be loaded safely, which imports torch); by the run's
    call for the newest one (the early call checks that one's model unverified, and leaves one
    whose meta.json is unreadable to the run's call). ``seed``: the run's ``trainer.seed``, which
    the checkpoint's data position must have been saved with."""
    started_from = resume
    if resume and continued(resume, ckpt_dir):
        resume = None  # the same command run again (after a stop): its own newer work wins
    if resume:
        check_named_checkpoint(resume, verify=early)
    if resume or not early:
        found = resume or newest_intact(ckpt_dir)
        if not found and not resume and committed_checkpoints(ckpt_dir):
            again = (f"move them away to start again from checkpoint.resume={started_from}, "
                     "which started them" if started_from else
                     "move them away, or set checkpoint.resume=PATH")
            raise CheckpointError(
                f"every committed checkpoint in {ckpt_dir} is damaged (each named above): not "
                f"starting over them (a new run would overwrite them step by step); {again}")
        if found:
            meta = saved_meta(found)
            check_compatible(found, gpt, meta, named=bool(resume))
            check_same_seed(found, meta, seed)
            if not resume:
                check_same_run(found, run_name, meta)
            else:
                check_dir_is_this_runs(ckpt_dir, run_name)
                if not rewind:
                    check_not_behind(resume, int(meta.get("step") or 0), ckpt_dir)
        if resume and early:
            from xtrain.checkpoint.io import check_loadable

            check_loadable(resume)
        return found
    found = latest_checkpoint(ckpt_dir)  # unverified: the run's call verifies it
    try:
        if found:
            meta = saved_meta(found)
            check_compatible(found, gpt, meta)
            check_same_run(found, run_name, meta)
    except CheckpointError:
        return None  # a damaged meta.json: the run's call passes this one over, with a warning
    if found:
        check_same_seed(found, meta, seed)
    return found


def check_same_seed(path: str, meta: dict, seed: int | None) -> None:
    """Refuse a checkpoint saved with another ``seed`` (None: unchecked) from its ``meta``, before
    the data preparation after which xtrain/train/loader_state.py would refuse its position."""
    saved = (meta.get("config") or {}).get("trainer", {}).get("seed")
    if seed is not None and saved is not None and saved != seed:
        raise CheckpointError(f"{path} was trained with trainer.seed={saved}, this run's is {seed}: the "
                              f"data position it holds is for that seed; resume with trainer.seed={saved}")


def check_same_run(path: str, run_name: str | None, meta: dict) -> None:
    """A run continues on its own only from its own checkpoints: refuse one another run wrote
    (a checkpoint.dir shared by runs or sweep jobs; the name keeps out what does not change the
    training, e.g. trainer.max_steps, so extending a run still resumes it). Retention would
    otherwise delete that run's checkpoints too. A checkpoint that names no run (in its
    ``meta``) passes."""
    written_by = run_of(meta, path) if run_name is not None else None
    if written_by is not None and written_by != run_name:
        raise ConfigError(
            f"{path} belongs to run {written_by}, not to this run ({run_name}): give each run its "
            "own checkpoint.dir (e.g. .../ckpt/${run.name}); to continue from it on purpose, set "
            f"checkpoint.resume={path} with a checkpoint.dir of this run's own")


def check_dir_is_this_runs(ckpt_dir: str, run_name: str | None) -> None:
    """A run started from ``checkpoint.resume`` writes into ``ckpt_dir``, whose retention deletes
    the commits there: refuse a dir whose newest commit (with a readable meta.json) another run
    wrote, as :func:`check_same_run` does without a resume."""
    for _, path in reversed(committed_checkpoints(ckpt_dir)):
        try:
            meta = read_meta(path)
        except (OSError, TypeError, ValueError, AttributeError):
            continue  # unreadable: passed over, as the run's own resume does
        check_same_run(path, run_name, meta)
        return


def continued(resume: str, directory: str) -> bool:
    """Whether the newest commit in ``directory`` (with a readable meta.json) was trained by a
    run started from ``resume``, as its config says: this run's own work since, which a re-run of
    the same command continues instead of starting (or rewinding) again, also once retention has
    deleted ``resume`` itself (a rewind's starting point in the same directory)."""
    for _, path in reversed(committed_checkpoints(directory)):
        try:
            config = read_meta(path).get("config") or {}
            return (config.get("checkpoint") or {}).get("resume") == resume
        except (OSError, TypeError, ValueError, AttributeError):
            continue  # unreadable: the run's own resume passes it over
    return False


def check_not_behind(resume: str, step: int, ckpt_dir: str) -> None:
    """Refuse to resume from an older step than the checkpoints this run would write over: each
    would be replaced as training reached its step (``checkpoint.*`` overrides keep the run's
    name, so its directory)."""
    newer = newer_commits(ckpt_dir, step)
    if newer:
        names = ", ".join(p.rstrip("/").rsplit("/", 1)[-1] for p in newer)
        raise CheckpointError(
            f"checkpoint.resume={resume} is older than the committed checkpoints in {ckpt_dir} "
            f"({names}), which this run would replace as it reached their steps: continue from the "
            "newest (without checkpoint.resume), train this branch elsewhere (run.name=... or "
            "checkpoint.dir=...), delete them, or set checkpoint.rewind=true (they are then "
            "renamed aside, kept)")


def check_named_checkpoint(resume: str, verify: bool = True) -> None:
    """Refuse a ``checkpoint.resume`` that is not one committed checkpoint or, with ``verify``,
    whose files no longer match its manifest."""
    fs, root = url_to_fs(resume)
    if not fs.exists(root):
        raise CheckpointError(f"checkpoint.resume={resume}: no such directory")
    if not fs.exists(f"{root}/{COMMIT_MARKER}"):
        inside = committed_checkpoints(resume)
        hint = (f"; it holds checkpoints: point at one of them, e.g. {inside[-1][1]}" if inside
                else "; an interrupted save, or not a checkpoint")
        raise CheckpointError(f"checkpoint.resume={resume}: not a committed checkpoint (no "
                              f"{COMMIT_MARKER} marker){hint}")
    corrupt = manifest.problems(resume) if verify else []
    if corrupt:
        raise CheckpointError(f"checkpoint.resume={resume} is corrupt: {'; '.join(corrupt)}")


def newest_intact(directory: str) -> str | None:
    """The newest committed checkpoint in ``directory`` whose files still match its manifest and
    hold every tensor its ``state.pt`` names. A newer committed one that does not (truncated,
    altered: the storage broke after the commit; saved incomplete) is named in a warning and
    passed over; a training run then renames it aside, kept for inspection (xtrain/train/run.py,
    resume_point)."""
    from xtrain.checkpoint.io import lacking, missing_tensors

    for _, path in reversed(committed_checkpoints(directory)):
        found = manifest.problems(path)
        if not found and (missing := missing_tensors(path)):
            found = [f"tensors/ lacks {lacking(missing)}"]
        if not found:
            return path
        warn(f"checkpoint {path} is corrupt ({'; '.join(found)}): not resuming from it, "
             "trying the previous committed one")
    return None


def check_tokenizer(directory: str) -> None:
    fs, root = url_to_fs(directory)
    if not fs.exists(root):
        raise DataError(f"data.tokenizer={directory}: no such directory")
    names = {p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(root, detail=False)}
    if "token_bytes.pt" not in names or not names & {"tokenizer.json", "tokenizer.pkl"}:
        raise DataError(f"data.tokenizer={directory}: needs tokenizer.json (or tokenizer.pkl) and "
                        f"token_bytes.pt, found {sorted(names) or 'nothing'}")


def check_data(data) -> None:
    """The tokenizer and the shards, unless the corpus is built on first use (then its output
    directory, which must be the build's to replace, and its sources)."""
    from xtrain.data import check_separate_splits
    from xtrain.data.corpus import check_output, checked_sources, read_manifest
    from xtrain.data.loader import holdout_last, list_shards

    if data.build_sources:
        if data.build_dir:
            check_output(list(data.build_sources), data.build_dir)
        checked_sources(list(data.build_sources))
        if data.build_dir and read_manifest(data.build_dir):  # a build in place: its shards
            check_separate_splits(data)  # (else checked once built: xtrain.data.prepare)
        return  # the tokenizer and shards are built (or reused) from them
    check_tokenizer(data.tokenizer)
    if data.holdout_last_shard:  # (then no val_files: xtrain.plan.check_validation_split)
        holdout_last(data.train_files)
        return
    if data.val_files:
        check_separate_splits(data)  # (lists both)
    else:
        list_shards(data.train_files)


def check_evaluation_steps(cfg) -> None:
    """On more than one process the C++ evaluation reads the weights of its step's checkpoint
    (xtrain/train/cpp_eval.py): every evaluated step must be a checkpointed one."""
    every, ckpt_every = cfg.eval.cpp_every, cfg.checkpoint.every
    processes = run_processes(cfg.hardware) if every else 1
    if processes > 1 and (not ckpt_every or every % ckpt_every):
        raise ConfigError(
            f"eval.cpp_every={every} on {processes} processes: the evaluation reads the "
            f"weights of the checkpoint of its step, so it must be a multiple of checkpoint.every "
            f"(now {ckpt_every}); set checkpoint.every={every}, for example")


def check_inputs(cfg, gpt: GPTConfig, run_dir: str) -> None:
    """Everything a training run reads and writes, in the order a run needs it: the checkpoints,
    then the data. Each part that reaches remote storage answers within data.remote_timeout_s;
    a local part has no deadline (verifying a checkpoint reads every byte of it)."""
    check_evaluation_steps(cfg)
    check_host(cfg.hardware)
    data, ckpt_dir = cfg.data, checkpoint_dir(cfg, run_dir)
    found = answered(data.remote_timeout_s, [ckpt_dir, cfg.checkpoint.resume],
                     lambda: _check_checkpoints(cfg, gpt, ckpt_dir, run_dir))
    built = [data.build_dir, *data.build_sources] if data.build_sources else []
    read = [data.train_files, data.val_files, data.tokenizer, cfg.compile_cache.dir, found, *built]
    answered(data.remote_timeout_s, read, lambda: _check_data_paths(cfg, found))


def saved_elsewhere(run_dir: str, ckpt_dir: str, timeout_s: float, step: int = -1):
    """(where, its commits past ``step``) when the last accepted training in ``run_dir`` saved
    its checkpoints elsewhere than ``ckpt_dir`` and some are still there, else None; a location
    that does not answer within ``timeout_s`` raises StorageError."""
    from omegaconf import OmegaConf

    record = os.path.join(run_dir, RECORD, "config.yaml")
    if not is_local(run_dir) or not os.path.isfile(record):
        return None
    try:
        earlier = checkpoint_dir(OmegaConf.load(record), run_dir)
    except Exception:  # noqa: BLE001  (a record of another version, or edited: it tells nothing)
        return None
    if location(earlier) == location(ckpt_dir):
        return None
    found: dict = {}
    within(timeout_s, earlier, lambda: found.update(newer=newer_commits(earlier, step)))
    return (earlier, found["newer"]) if found.get("newer") else None


def check_checkpoints_not_elsewhere(run_dir: str, ckpt_dir: str, timeout_s: float,
                                    resumes: str | None = None) -> None:
    """Refuse to go on in a run dir whose last accepted training saved its checkpoints elsewhere,
    where they still are, newer than ``resumes`` (the checkpoint this command would resume from;
    None: it would start from step 0): a ``checkpoint.dir`` override left off (such overrides
    keep the run's name, so its dir) would train those steps again over the run's records. A
    location that does not answer within ``timeout_s`` is said and passed over."""
    step = step_of(resumes) if resumes else -1
    try:
        elsewhere = saved_elsewhere(run_dir, ckpt_dir, timeout_s, step)
    except StorageError as e:
        warn(f"the last training in {run_dir} saved its checkpoints elsewhere, which could not be "
             f"read ({e}); this run starts from {resumes or 'step 0'} in checkpoint.dir={ckpt_dir}")
        return
    if elsewhere:
        earlier, newer = elsewhere
        here, again = (f"checkpoint.dir={ckpt_dir} holds no checkpoint of this run", "from step 0")
        if resumes:
            here, again = f"this command would resume from {resumes}", f"from step {step}"
        raise ConfigError(
            f"{here}, but the last training in {run_dir} ({RECORD}/config.yaml) saved its "
            f"checkpoints to {earlier}, newest {newer[-1]}: this command would train "
            f"{again} over the run's records; to continue it, add checkpoint.dir={earlier}; to "
            "start anew, choose another run.name")


def _check_checkpoints(cfg, gpt: GPTConfig, ckpt_dir: str, run_dir: str) -> str | None:
    """The checkpoint this run would resume from (None: none), once checked."""
    found = resume_checkpoint(cfg.checkpoint.resume, ckpt_dir, gpt, cfg.run.name, early=True,
                              rewind=cfg.checkpoint.rewind, seed=cfg.trainer.seed)
    if not cfg.checkpoint.resume:
        check_checkpoints_not_elsewhere(run_dir, ckpt_dir, cfg.data.remote_timeout_s, found)
    check_writable(ckpt_dir)
    return found


def _check_data_paths(cfg, found: str | None) -> None:
    from xtrain.data import check_build_keeps
    from xtrain.data.tokenizer import file_fingerprint

    cache = cfg.compile_cache  # its mirror is pushed to after the first step's compile
    if cfg.hardware.engine == "xla" and compile_cache_enabled(cache, cfg.hardware) and cache.dir \
            and not is_local(cache.dir):
        check_writable(cache.dir, "compile_cache.dir")
    check_data(cfg.data)
    if found and cfg.data.build_sources:  # its tokenizer is checked once built (train/run.py)
        check_build_keeps(cfg.data, found, saved_meta(found).get("tokenizer_sha256"))
    elif found:
        check_same_tokenizer(found, saved_meta(found), file_fingerprint(cfg.data.tokenizer))


def check_same_tokenizer(path: str, meta: dict, fingerprint: str | None,
                         remedy: str = "use that run's data config, or start a new run (run.name=...)",
                         ours: str = "this run's") -> None:
    """Refuse a checkpoint trained with another tokenizer than the run's (``fingerprint``; its
    ``meta`` records the sha256 of its own): its token ids mean other text. Either unknown passes."""
    trained_with = meta.get("tokenizer_sha256")
    if trained_with and fingerprint and trained_with != fingerprint:
        raise CheckpointError(
            f"{path} was trained with the tokenizer of {meta['config']['data']['tokenizer']} "
            f"(sha256 {trained_with[:12]}), not with {ours} (sha256 {fingerprint[:12]}): "
            f"its token ids mean other text; {remedy}")


def checkpoint_tokenizer(path: str, meta: dict, given: str | None) -> str:
    """Where ``mode=sample``/``eval`` read the tokenizer of the checkpoint at ``path`` (``meta``
    its meta.json): the directory its config names, else ``given`` (this command's
    data.tokenizer, e.g. a copy), the first holding the tokenizer whose sha256 the checkpoint
    records (any tokenizer, when it records none). Never built: a command that only reads must not
    write into the shared corpus cache, nor at a place a checkpoint's meta.json chooses. Refused
    when neither holds it."""
    from xtrain.data.tokenizer import file_fingerprint

    data = saved_config(meta, path).data
    recorded, trained_with = data.tokenizer, meta.get("tokenizer_sha256")
    found = {}  # directory -> the fingerprint of the tokenizer it holds
    for directory in dict.fromkeys(d for d in (recorded, given) if d):
        found[directory] = file_fingerprint(directory)
        if found[directory] and (not trained_with or found[directory] == trained_with):
            return directory
    # (a data.* override names another run, whose dir holds no checkpoint: hence the resume)
    copy = f"add data.tokenizer=<a copy of that tokenizer> checkpoint.resume={path}"
    other = next(((d, f) for d, f in found.items() if f), None)
    if other:  # (the first directory holding a tokenizer: refused)
        check_same_tokenizer(path, meta, other[1], ours=f"the one in {other[0]}",
                             remedy=copy.replace("that tokenizer", "the tokenizer it was trained with"))
    dirs = list(found)
    none = (f"{dirs[0]} holds no tokenizer" if len(dirs) == 1 else
            f"neither {dirs[0]} nor {dirs[1]} holds a tokenizer")
    build = ("run the training command of that checkpoint once on this machine (it builds the "
             "corpus and its tokenizer)" if data.get("build_sources") else "copy it there (its "
             "training read a corpus made beforehand, e.g. by python -m xtrain.data build)")
    raise DataError(f"{path} was trained with the tokenizer of {recorded}, and {none} (mode=sample "
                    f"and mode=eval build no corpus): {build}, or {copy}")
