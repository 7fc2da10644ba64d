"""``python -m xtrain``: the Hydra app. Composes the config groups, then hands the job to its mode
(xtrain/modes.py). Refused input (xtrain/errors.py) ends with one line on stderr and exit code 2.

Heavy libraries (torch, lightning, torch_xla) are imported only once a mode needs them, so
``--help``, ``--cfg job``, tab completion and ``mode=plan`` stay fast.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig

from xtrain.config import register
from xtrain.errors import EXIT_PEER_LOST, EXIT_REFUSED, InputError, PeerLost


def config_dir() -> str:
    """Installed wheels carry the configs as xtrain/conf; a source checkout has them at ../conf."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "conf", here.parent / "conf"):
        if (candidate / "train.yaml").exists():
            return str(candidate)
    raise FileNotFoundError(f"xtrain configs not found next to {here}")


register()


@hydra.main(version_base="1.3", config_path=config_dir(), config_name="train")
def _main(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig

    from xtrain.modes import run

    try:
        summary = run(cfg, HydraConfig.get().runtime.output_dir)
    except InputError as e:  # bad input: a one-line reason, not a traceback
        print(f"xtrain: {e.kind} error: {e}", file=sys.stderr)
        sys.exit(EXIT_REFUSED)
    except PeerLost as e:
        print(f"xtrain: error: {e}", file=sys.stderr, flush=True)
        sys.exit(EXIT_PEER_LOST)
    if summary and summary.get("preempted"):
        sys.exit(143)  # 128 + SIGTERM: not finished; re-running the command resumes


def secondary_process_overrides(env=os.environ) -> list[str]:
    """Hydra overrides for a process other than the first of a multi-process run (RANK > 0, as
    torchrun and xtrain's launchers set it): it writes no Hydra files into the run directory the
    processes may share (no .hydra/ copy of the config, no log file; it logs to stdout). What a
    run writes is process 0's job; the overrides do not change the run's name."""
    if env.get("RANK", "0") in ("", "0"):
        return []
    return ["hydra.output_subdir=null", "hydra/job_logging=stdout"]


def main() -> None:
    sys.argv += secondary_process_overrides()
    _main()
