"""``python -m xtrain``: the Hydra app. Composes the config groups, resolves and checks every
derived number (printing the plan) before anything expensive starts, then runs the chosen mode.

Heavy libraries (torch, lightning, torch_xla) are imported only once a mode needs them, so
``--help``, ``--cfg job``, tab completion and ``mode=plan`` stay fast.
"""

from __future__ import annotations

import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

from xtrain.config import ConfigError, register


def config_dir() -> str:
    """Installed wheels carry the configs as xtrain/conf; a source checkout has them at ../conf."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "conf", here.parent / "conf"):
        if (candidate / "train.yaml").exists():
            return str(candidate)
    raise FileNotFoundError(f"xtrain configs not found next to {here}")


register()


def run(cfg: DictConfig, run_dir: str) -> dict | None:
    """Resolve, check, print the plan, then dispatch on ``cfg.mode``."""
    from xtrain.hardware import run_devices
    from xtrain.plan import check_fits, resolve

    plan = resolve(cfg, run_devices(cfg.hardware))
    print(f"run {cfg.run.name} -> {run_dir}\n{plan.describe()}", flush=True)
    if cfg.mode == "compile":  # the TPU compiler, not the estimate, decides whether it fits
        from xtrain.preflight import preflight

        preflight(cfg, plan)
        return None
    if cfg.mode == "plan" and cfg.hardware.accelerator_type:
        from xtrain.preflight import cached_report, describe

        report = cached_report(cfg, plan)
        print(describe(report) if report else "TPU compiler: not run yet for this config "
                                              "(mode=compile)")
    check_fits(plan)
    if cfg.mode == "plan":
        print("plan: fits" + (f" in {cfg.hardware.hbm_gib_per_chip:g} GiB HBM per chip"
                               if cfg.hardware.hbm_gib_per_chip else ""))
        return None
    from xtrain.train.run import train  # mode=train (resolve() refused any other mode)

    return train(cfg, plan, run_dir)


@hydra.main(version_base="1.3", config_path=config_dir(), config_name="train")
def _main(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig

    from xtrain.data import DataError

    try:
        summary = run(cfg, HydraConfig.get().runtime.output_dir)
    except (ConfigError, DataError) as e:  # bad input: a one-line reason, not a traceback
        print(f"xtrain: {'config' if isinstance(e, ConfigError) else 'data'} error: {e}",
              file=sys.stderr)
        sys.exit(2)
    if summary and summary.get("preempted"):
        sys.exit(143)  # 128 + SIGTERM: not finished; re-running the command resumes


def main() -> None:
    _main()


__all__ = ["main", "run", "config_dir", "OmegaConf"]
