"""Names that identify a run and its derived caches, from the config alone.

A run's name is ``<model>-<hardware>-<data>``, the primary config's name when it is not
conf/train.yaml (``--config-name``, or ``--config-path`` elsewhere), plus the overrides that
change what is trained (``d2-cpu-cpp_local-optim.matrix_lr_0.01``). It is deterministic (no
timestamp): re-running a command lands in the same directory and resumes. Overrides that do not change what is trained
(``trainer.max_steps``, logging, checkpoint placement, ...) keep the name, so extending a run
resumes it; but in a sweep every job's name carries all of its overrides, so jobs that differ
only in such a key still get directories of their own. A name too long for a file name keeps a
readable prefix and a hash of the whole (the full list is in ``.hydra/overrides.yaml``).
A sweep's own dir (``multirun/<sweep>/``) is named the same way from its command line alone.
"""

from __future__ import annotations

import contextvars
import hashlib
import os
import re

from xtrain.paths import PRIMARY_CONFIG, cache_root, config_dir

# Overrides that do not change what is trained, so they keep the run's name (and its checkpoints).
NAME_NEUTRAL_KEYS = ("mode",)
NAME_NEUTRAL_PREFIXES = ("trainer.max_steps", "trainer.log_every", "trainer.eval", "trainer.sample",
                         "run.", "checkpoint.", "logger", "sample.", "hydra.", "data.prefetch",
                         "data.tokenizer_threads", "data.remote_timeout_s",
                         "trainer.collective_timeout_s", "preemption.",
                         "eval.",  # how checkpoints are judged, not what is trained
                         # how the same training is compiled and run (same losses, same keys)
                         "compile_cache.", "preflight.", "model.scan", "model.remat",
                         "trainer.compile", "trainer.max_compiles", "trainer.profile",
                         # the run's length, as trainer.max_steps
                         "trainer.target_tokens_per_param",
                         # the planner's estimates and the launchers' VM image
                         "hardware.hourly_usd", "hardware.expected_mfu",
                         "hardware.runtime_version", "hardware.python")
GROUPS_IN_NAME = ("model", "hardware", "data")
READS_CHECKPOINT = ("sample", "eval")  # modes that read a checkpoint instead of training
MAX_NAME = 120  # bytes of a derived name
NAME_MAX = 255  # bytes of any run name: file systems allow no longer path component


def shorten(parts: list[str], limit: int = MAX_NAME) -> str:
    """``parts`` joined by ``-`` when short enough, else a prefix cut at ``limit`` and a hash of
    the whole. The prefix may end inside a value (``max_steps_2`` for 200; the hash tells such
    names apart): names of runs already trained must stay as they are, or they would not resume."""
    name = "-".join(parts)
    if len(name.encode()) <= limit:
        return name
    digest = hashlib.sha256(name.encode()).hexdigest()[:12]
    return name.encode()[:limit - 13].decode(errors="ignore").rstrip("-_.") + "-" + digest


def override_pairs(overrides: list[str]) -> dict[str, str]:
    """``{key: value}`` of Hydra overrides, without the ``+``/``~`` of the key or quotes around
    the value."""
    return {o.partition("=")[0].lstrip("+~"): o.partition("=")[2].strip("'\"") for o in overrides}


def names_checkpoint(overrides: list[str]) -> bool:
    """Whether ``overrides`` name a checkpoint to start from (checkpoint.resume=PATH)."""
    return override_pairs(overrides).get("checkpoint.resume", "").lower() not in ("", "null", "~")


def compose_name(choices: dict, overrides: list[str], sweep: bool, primary: str | None = None) -> str:
    """A run's or a sweep's name; ``primary``: :func:`other_primary_config`."""
    given, extra = {}, []
    pairs = override_pairs(overrides)
    if pairs.get("mode") in READS_CHECKPOINT and names_checkpoint(overrides) and not sweep:
        # sampling or judging a checkpoint named by path logs (and keeps records) with the run
        # it belongs to, not in the dir of the run these groups would train
        return shorten([checkpoint_run(pairs["checkpoint.resume"])])
    for override in overrides:
        key, _, value = override.partition("=")
        key = key.lstrip("+~")
        neutral = key in NAME_NEUTRAL_KEYS or key.startswith(NAME_NEUTRAL_PREFIXES)
        if key in GROUPS_IN_NAME:
            given[key] = plain(value)  # as written: a sweep's command keeps its list (model=d12,d16)
        elif not (key.startswith(("hydra.", "hydra/")) or (neutral and not sweep)):
            extra.append(plain(override.lstrip("+~")))
    parts = [given.get(group, choices.get(group)) for group in GROUPS_IN_NAME] + [primary]
    return shorten([str(p) for p in parts + sorted(extra) if p])


def other_primary_config(hydra_cfg) -> str | None:
    """The primary config's name when it is not xtrain's conf/train.yaml (another
    ``--config-name``, or ``--config-path`` elsewhere), else None. Such a config sets what is
    trained in its own body, where no override shows it, so the names of its runs and sweeps hold
    it. Its name, not its dir: as after an edit of conf/, the same name elsewhere is the same run."""
    name = primary_config_name(hydra_cfg)
    if name == PRIMARY_CONFIG and not config_dirs_elsewhere(hydra_cfg, provider="main"):
        return None
    return plain(name)


def primary_config_name(hydra_cfg) -> str:
    """The primary config's name as Hydra finds it (``train.yaml`` and ``/train`` are ``train``)."""
    return str(hydra_cfg.job.config_name).lstrip("/").removesuffix(".yaml")


def config_dirs_elsewhere(hydra_cfg, provider: str | None = None) -> list[str]:
    """Config dirs and packages on Hydra's search path other than xtrain's conf/
    (``--config-path``, ``--config-dir``, ``hydra.searchpath``), of ``provider`` only when given;
    Hydra's own configs (provider ``hydra``) and the schemas are not such dirs."""
    ours = os.path.realpath(config_dir())
    return [source.path for source in hydra_cfg.runtime.config_sources
            if source.schema in ("file", "pkg") and source.provider != "hydra"
            and provider in (None, source.provider) and _where(source) != ours]


def _where(source) -> str | None:
    """The directory of a config source: a path, or an importable package's files (a relative
    ``--config-path`` is a package to Hydra)."""
    import importlib.resources

    if source.schema == "file":
        return os.path.realpath(source.path)
    try:
        return os.path.realpath(str(importlib.resources.files(source.path.replace("/", "."))))
    except (ImportError, TypeError, ValueError):
        return None


def checkpoint_run(path: str) -> str:
    """The name of the run a checkpoint belongs to: the dir holding it, or the one above when that
    is ``checkpoints`` (``outputs/<run>/checkpoints/step_N``, ``gs://bucket/ckpt/<run>/step_N``)."""
    dirs = [d for d in path.rstrip("/").split("/")[:-1] if d not in ("", ".", "..")]
    if dirs and dirs[-1] == "checkpoints":
        dirs.pop()
    return plain(dirs[-1]) if dirs else "checkpoint"


def plain(text: str) -> str:
    """``text`` without path separators, and characters storage tools read as patterns (*?[])
    or quote."""
    return re.sub(r"[/=*?\[\]\s'\"\\]", "_", text)


def check_run_name(name: str) -> None:
    """A run's name is one directory under outputs/ (and in checkpoint dirs): refuse one that
    would be outputs/ itself, climb out of it, nest, or be read as a pattern by storage tools."""
    from xtrain.errors import ConfigError

    if not name.strip() or name != name.strip() or name in (".", "..") or \
            re.search(r"[/\\*?\[\]]", name) or len(name.encode()) > NAME_MAX:
        raise ConfigError(f"run.name={name!r}: a run's name must be one plain directory name: "
                          "not empty, no leading or trailing spaces, none of / \\ * ? [ ], "
                          f"not . or .., at most {NAME_MAX} bytes")


def run_dir_name(name: str) -> str:
    """The ``${xtrain_run_dir_name:${run.name}}`` resolver of conf/train.yaml's run and sweep
    dirs: the run's name, checked (:func:`check_run_name`) before Hydra makes its directory,
    once interpolations are resolved."""
    check_run_name(name)
    return name


# Set while resolved_override resolves an override's value, when run_name gives NAME_PENDING instead.
_RESOLVING_OVERRIDE = contextvars.ContextVar("xtrain_resolving_override", default=False)
NAME_PENDING = "xtrain-run-name-pending"


def run_name(*, _root_) -> str:
    """The ``${xtrain_run_name:}`` resolver: the name of the job Hydra is composing (``_root_``:
    its config, given by OmegaConf)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode
    from omegaconf import OmegaConf

    if _RESOLVING_OVERRIDE.get():
        return NAME_PENDING
    hc = HydraConfig.get()
    overrides = OmegaConf.to_container(hc.overrides.task, resolve=False)
    sweep = hc.mode == RunMode.MULTIRUN
    kept = [resolved_override(o, _root_, sweep) if interpolates(o) else o for o in overrides]
    return compose_name(dict(hc.runtime.choices), [o for o in kept if o], sweep=sweep,
                        primary=other_primary_config(hc))


def resolved_override(override: str, root, sweep: bool) -> str | None:
    """An override whose value interpolates (``'model.depth=${oc.env:D}'``) with its value in
    the composed config ``root``, so that the name holds what is trained: a string by its digest
    (it may be a secret: a token, a signed URL), but outside a sweep ``checkpoint.resume``'s path
    as it is (a command reading that checkpoint is named after its run, :func:`compose_name`). None for
    Hydra's own keys, a value that does not resolve to one plain value, and one built from the
    run's own name (``checkpoint.dir=gs://b/${run.name}``, which is not known yet)."""
    from enum import Enum

    from omegaconf import Container, OmegaConf

    key = override.partition("=")[0].lstrip("+~")
    if key.startswith(("hydra.", "hydra/")):
        return None
    token = _RESOLVING_OVERRIDE.set(True)
    try:
        value = OmegaConf.select(root, key, throw_on_resolution_failure=False)
    finally:
        _RESOLVING_OVERRIDE.reset(token)
    if value is None or isinstance(value, Container) or NAME_PENDING in str(value):
        return None
    if isinstance(value, Enum):  # (xtrain's enums are str's too)
        value = value.value
    elif isinstance(value, str) and not (key == "checkpoint.resume" and not sweep):
        value = "sha-" + hashlib.sha256(value.encode()).hexdigest()[:8]
    elif isinstance(value, bool):
        value = str(value).lower()
    return f"{key}={value}"


def interpolates(override: str) -> bool:
    """Whether an override's value holds an interpolation: ``${...}`` as written, or ``$\\{...}``
    as Hydra's basic sweeper escapes it in a sweep's job overrides."""
    return re.search(r"\$\\?\{", override) is not None


def sweep_name() -> str | None:
    """The ``${xtrain_sweep_name:}`` resolver: in a sweep (``-m``), the sweep's name
    (:func:`sweep_dir_name`), the same for every job, so it groups them (W&B's group). None
    outside a sweep."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    hc = HydraConfig.get()
    return sweep_dir_name(hc) if hc.mode == RunMode.MULTIRUN else None


def sweep_dir_resolver(*, _root_) -> str:
    """The ``${xtrain_sweep_dir_name:}`` resolver of conf/train.yaml's sweep dir: its name from
    the config's own ``hydra`` section, as the sweep dir resolves before Hydra's config is set;
    from Hydra's config where a job's config is held apart from that section (by Hydra's ``--cfg
    job``, or xtrain/sweeps.py)."""
    from hydra.core.hydra_config import HydraConfig

    return sweep_dir_name(_root_.hydra if "hydra" in _root_ else HydraConfig.get())


def sweep_dir_name(hydra_cfg) -> str:
    """The name of conf/train.yaml's sweep dir, so that each sweep command keeps its jobs and
    its multirun.yaml in a dir of its own, and the same command run again resumes its jobs
    there: the command line alone named like a sweep's job (another primary config's name, every
    override but Hydra's and those that interpolate, swept values as written:
    ``d2-optim.matrix_lr_0.01,0.02``); ``defaults`` for none. Nothing else: Hydra resolves the
    sweep dir in the sweep's config and again in each job's, where a config group may differ
    (``-m +experiment=a,b``) and an interpolation would resolve to each job's value."""
    import sys

    command = [a for a in sys.argv[1:] if ("=" in a or a.startswith("~")) and not a.startswith("-")
               and not interpolates(a)]
    name = compose_name({}, command, sweep=True, primary=other_primary_config(hydra_cfg)) or "defaults"
    check_run_name(name)
    return name


def corpus_dir(name: str, vocab_size: int, chunk_tokens: int, sources) -> str:
    """The ``${xtrain_corpus:...}`` resolver: where a corpus built from ``sources`` with this
    vocabulary and chunking lives, so configs that differ in any of them never share (or
    overwrite) a corpus or tokenizer."""
    key = hashlib.sha256(repr(sorted(map(str, sources))).encode()).hexdigest()[:8]
    return str(cache_root() / "corpus" / f"{name}-v{vocab_size}-c{chunk_tokens}-{key}")
