"""Checks of a composed config that need nothing but the config and Hydra's choices: which group
options may be chosen (conf/<group>/<option>.yaml), which keys exist, the run's name and dir."""

from __future__ import annotations

import os
from pathlib import Path

from xtrain.errors import ConfigError


def is_base(option) -> bool:
    """A config group option that is a base (a file named ``_*``, such as conf/hardware/_tpu.yaml):
    other options extend it, alone it is incomplete."""
    return isinstance(option, str) and option.startswith("_")


def check_choices(choices) -> None:
    """Refuse a base chosen as a config group option. ``choices``: Hydra's group -> option."""
    bases = [f"{group}={option}" for group, option in choices.items() if is_base(option)]
    if bases:
        raise ConfigError(f"{', '.join(bases)}: a base that the group's options extend, not an "
                          "option to choose (choose one whose name has no leading _)")


def config_groups() -> str:
    """The ``${xtrain_config_groups:}`` resolver of ``--help`` (conf/train.yaml): each config
    group with the options that may be chosen, one line each. Hydra's own ``$APP_CONFIG_GROUPS``
    lists the bases too, which :func:`check_choices` then refuses."""
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.object_type import ObjectType

    loader = GlobalHydra.instance().config_loader()

    def lines(parent: str) -> list[str]:
        out = []
        for name in sorted(loader.list_groups(parent)):
            group = f"{parent}/{name}" if parent else name
            if group == "hydra":
                continue
            options = [o for o in sorted(loader.get_group_options(group, ObjectType.CONFIG))
                       if not is_base(o)]
            if options:
                out.append(f"{group}: {', '.join(options)}")
            out += lines(group)
        return out

    return "\n".join(lines(""))


def check_group_overrides(args: list[str]) -> None:
    """Refuse ``group=null`` (Hydra ends it in a traceback) and a list for a group conf/train.yaml
    chooses one option of (``model=[d2,d4]`` merged both configs into one run, named after the
    list); a list stays for the groups it chooses a list of (``logger``) and for presets added
    with ``+`` (``+debug=[fast,profile]``, deltas both)."""
    from omegaconf import ListConfig, OmegaConf

    from xtrain.paths import PRIMARY_CONFIG, config_dir

    groups = {p.name for p in Path(config_dir()).iterdir() if p.is_dir()}
    chosen = {group: option for entry in OmegaConf.load(Path(config_dir(), f"{PRIMARY_CONFIG}.yaml")).defaults
              if not isinstance(entry, str) for group, option in entry.items()}
    for arg in args:
        key, assigned, value = arg.partition("=")
        group, value = key.lstrip("+~"), value.strip()
        if not assigned or key.startswith("-") or group not in groups:
            continue
        if value.lower() == "null":  # (Hydra reads null in any case)
            several = isinstance(chosen.get(group), ListConfig)
            raise ConfigError(f"{arg}: a config group takes one of its options, not null"
                              + (" (metrics.jsonl is always written: logger=jsonl adds no other)"
                                 if several else ""))
        if value.startswith("[") and isinstance(chosen.get(group), str):
            options = value.strip("[] ")
            raise ConfigError(f"{arg}: {group} takes one option" + (
                f" (a list merges them into one run); to train each, sweep them: -m {group}={options}"
                if options else ""))


def check_composed(cfg, hydra_cfg) -> None:
    """Every check of a composed job that needs nothing but its config and Hydra's (its
    ``hydra`` section: the choices, and what a config file set there): by the CLI, before each
    job of a sweep (xtrain/sweeps.py), and before a launch."""
    from omegaconf import OmegaConf

    from xtrain.config.secrets import check_no_secret_in_names, check_no_secret_values
    from xtrain.naming import check_run_name

    check_choices(hydra_cfg.runtime.choices)
    check_known_keys(cfg)
    check_no_secret_values(cfg)
    check_no_secret_values(hydra_cfg, "hydra.")
    check_no_secret_in_names({"run.name": cfg.run.name,  # resolved: they may interpolate
                              "hydra.runtime.output_dir": OmegaConf.select(
                                  hydra_cfg, "runtime.output_dir", default=None) or ""})
    check_run_name(cfg.run.name)
    check_local_dir(hydra_cfg)


def check_local_dir(hydra_cfg) -> None:
    """Refuse a URL as the job's dir (``hydra.run.dir=gs://b/x`` or ``file:///x``, or a sweep's
    ``hydra.sweep.dir``):
    Hydra makes it on this machine, so the job would train into a local ``./gs:/b/x`` (its
    made dirs are removed again on refusal: xtrain/config/hydra_record.py, xtrain/sweeps.py)."""
    from hydra.types import RunMode
    from omegaconf import OmegaConf

    from xtrain.paths import is_local

    key = "sweep.dir" if hydra_cfg.mode == RunMode.MULTIRUN else "run.dir"
    where = str(OmegaConf.select(hydra_cfg, key))
    if not is_local(where) or "://" in where:  # (file:///x too: Hydra makes ./file:/x)
        raise ConfigError(f"hydra.{key}={where}: Hydra makes this dir on this machine (here: "
                          f"{os.path.abspath(where)}); give a local dir, and put checkpoints in a "
                          "bucket with checkpoint.dir=gs://...")


def check_known_keys(cfg, prefix: str = "") -> None:
    """Refuse keys the schema does not have. Hydra's ``+key=value`` adds a key even to a typed
    section, where nothing reads it: ``+trainer.max_step=5`` would train the default number of
    steps. Free-form maps (``hardware.env``) take any key. ``prefix``: where ``cfg`` sits in the
    whole config (``hydra.launcher.``)."""
    unknown = _unknown_keys(cfg, prefix)
    if unknown:
        raise ConfigError("; ".join(unknown) + ": the config has no such key (a '+' override adds "
                          "keys only to free-form maps such as hardware.env or hydra.launcher.env)")


def _unknown_keys(node, path: str) -> list[str]:
    import dataclasses
    import difflib

    from omegaconf import DictConfig, OmegaConf

    out = []
    schema = OmegaConf.get_type(node)
    if dataclasses.is_dataclass(schema):
        names = [f.name for f in dataclasses.fields(schema)]
        for key in node:
            if key not in names:
                near = difflib.get_close_matches(str(key), names, n=1)
                out.append(f"{path}{key}" + (f" (did you mean {path}{near[0]}?)" if near else ""))
    for key in node:
        if OmegaConf.is_missing(node, key) or OmegaConf.is_interpolation(node, key):
            continue
        child = node[key]
        if isinstance(child, DictConfig):  # (a None section reads as None)
            out += _unknown_keys(child, f"{path}{key}.")
    return out
