"""Checks of a composed config that need nothing but the config and Hydra's choices: which group
options may be chosen (conf/<group>/<option>.yaml), which keys exist, the run's name."""

from __future__ import annotations

from xtrain.errors import ConfigError


def check_choices(choices) -> None:
    """Refuse a config group option that is a base (a file named ``_*``, such as
    conf/hardware/_tpu.yaml): other options extend it, alone it is incomplete. ``choices``:
    Hydra's group -> option."""
    bases = [f"{group}={option}" for group, option in choices.items()
             if isinstance(option, str) and option.startswith("_")]
    if bases:
        raise ConfigError(f"{', '.join(bases)}: a base that the group's options extend, not an "
                          "option to choose (choose one whose name has no leading _)")


def check_composed(cfg, choices) -> None:
    """Every check of a composed job that needs nothing but its config and Hydra's choices: by
    the CLI, before each job of a sweep (xtrain/sweeps.py), and before a launch."""
    from xtrain.naming import check_run_name

    check_choices(choices)
    check_known_keys(cfg)
    check_run_name(cfg.run.name)  # resolved: it may interpolate


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
