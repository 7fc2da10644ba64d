"""``python -m xtrain``: the Hydra app. Composes the config groups, then hands the job to its mode
(xtrain/modes.py).

Refused input, whether Hydra's (an unknown option, key or choice, a wrong type) or xtrain's
(xtrain/errors.py: a value out of range, a missing path), ends with one line on stderr and exit
code 2 (EXIT_REFUSED); ``HYDRA_FULL_ERROR=1`` shows the traceback instead. Heavy libraries
(torch, lightning, torch_xla) are imported only once a mode needs them, so ``--help``, ``--cfg
job``, tab completion, ``mode=plan`` and every refusal stay fast.
"""

from __future__ import annotations

import os
import sys

import hydra
from omegaconf import DictConfig

from xtrain import compat
from xtrain.config import register
from xtrain.errors import EXIT_REFUSED, InputError
from xtrain.paths import config_dir


def is_refusal(ex: BaseException) -> bool:
    from hydra.errors import CompactHydraException
    from omegaconf.errors import OmegaConfBaseException

    return isinstance(ex, (InputError, CompactHydraException, OmegaConfBaseException))


def one_line(ex: BaseException) -> str:
    """The refusal as one line: xtrain's message, or Hydra's and OmegaConf's multi-line reports
    folded (the field's full key first; a list of available options joined, without the
    ``_``-prefixed bases and Hydra's search path)."""
    from omegaconf.errors import OmegaConfBaseException

    if isinstance(ex, InputError):
        return f"xtrain: {ex.kind} error: {ex}"
    cause = ex.__cause__ if isinstance(ex.__cause__, OmegaConfBaseException) else ex
    if isinstance(cause, OmegaConfBaseException) and getattr(cause, "full_key", None):
        return f"xtrain: config error: {cause.full_key}: {str(cause).splitlines()[0]}"
    lines = str(ex).split("Config search path:")[0].splitlines()
    text = [line.strip().rstrip(":") for line in lines
            if line.strip() and not line.startswith(("\t", "See https://"))]
    if getattr(ex, "override", None):  # an override Hydra's grammar cannot parse
        text.insert(0, f"cannot parse override {ex.override!r}")
    items = [line.strip() for line in lines if line.startswith("\t") and not line.strip().startswith("_")]
    return "xtrain: config error: " + "; ".join(text) + (": " + ", ".join(items) if items else "")


def refuse(ex: BaseException) -> None:
    print(one_line(ex), file=sys.stderr, flush=True)
    sys.exit(EXIT_REFUSED)


compat.report_refusals(is_refusal, refuse)
register()


@hydra.main(version_base="1.3", config_path=config_dir(), config_name="train")
def _main(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig

    from xtrain.modes import run

    try:
        summary = run(cfg, HydraConfig.get().runtime.output_dir)
    except Exception as ex:  # noqa: BLE001  (refusals end here, in one line; the rest is raised)
        if not is_refusal(ex) or os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        refuse(ex)
    if summary and summary.get("preempted"):
        sys.exit(143)  # 128 + SIGTERM: not finished; re-running the command resumes


def main() -> None:
    _main()
