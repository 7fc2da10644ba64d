"""Which config group options may be chosen (conf/<group>/<option>.yaml)."""

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
