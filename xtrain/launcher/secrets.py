"""Secrets a job needs (W&B, Hugging Face, any name in ``hydra.launcher.secrets``): taken from the
local environment and handed to xtrain/launcher/job.py, which sends them over ssh's stdin into a
0600 file the job reads and deletes. Never on a command line (``ps`` shows those), in a synced
file, a run script, a log or a printed command; configs name the variables, never their values."""

from __future__ import annotations

import os
import re

from xtrain.errors import ConfigError
from xtrain.config.secrets import SECRET_NAMES_VAR, declare_secret_names, wandb_key

ALWAYS = ("WANDB_API_KEY", "HF_TOKEN")


def collect(extra_names=()) -> dict[str, str]:
    """name -> value for each secret set in this process's environment, plus the list of their
    names (SECRET_NAMES_VAR), so the job masks every one of them, whatever its name says. A W&B
    key stored by ``wandb login`` goes as WANDB_API_KEY: it makes local runs online, and the
    workers have no copy of ~/.netrc."""
    names = list(dict.fromkeys([*ALWAYS, *extra_names]))
    bad = [n for n in names if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", n)]
    if bad:
        raise ConfigError(f"hydra.launcher.secrets: {', '.join(bad)} is not an environment "
                          "variable name (list names; values come from the environment)")
    declare_secret_names(names)  # the code synced and this side's logs are checked for them too
    found = {n: os.environ[n] for n in names if n in os.environ}
    if not found.get("WANDB_API_KEY") and (stored := wandb_key()):
        found["WANDB_API_KEY"] = stored
    return {**found, SECRET_NAMES_VAR: ",".join(found)} if found else {}
