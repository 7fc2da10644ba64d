"""What ``python -m xtrain`` does with a composed config: resolve and check it (printing the plan),
then run its ``mode``. Heavy libraries are imported only by the modes that need them, so
``mode=plan`` stays fast and torch-free."""

from __future__ import annotations

from xtrain.config import Mode
from xtrain.hardware import run_devices
from xtrain.inputs import check_inputs
from xtrain.plan import RunPlan, check_fits, resolve


def plan_run(cfg, where: str) -> RunPlan:
    """Resolve and check the config, and print the plan (also before a remote launch)."""
    plan = resolve(cfg, run_devices(cfg.hardware))
    print(f"run {cfg.run.name} -> {where}\n{plan.describe()}", flush=True)
    return plan


def run(cfg, run_dir: str) -> dict | None:
    """Resolve, check, print the plan, then dispatch on ``cfg.mode``."""
    plan = plan_run(cfg, run_dir)
    if cfg.mode == Mode.compile:
        return compile_for_tpu(cfg, plan)
    if cfg.mode == Mode.plan:
        return show_plan(cfg, plan)
    check_fits(plan, cfg)
    check_inputs(cfg, plan.gpt, run_dir)  # before data preparation, the model build or a compile
    from xtrain.train.run import train

    return train(cfg, plan, run_dir)


def compile_for_tpu(cfg, plan: RunPlan) -> None:
    """The TPU compiler, not the estimate, decides whether the step fits."""
    from xtrain.preflight.runner import preflight

    preflight(cfg, plan)


def show_plan(cfg, plan: RunPlan) -> None:
    if cfg.hardware.accelerator_type:
        from xtrain.preflight.cache import cached_report
        from xtrain.preflight.report import describe

        report = cached_report(cfg, plan)
        print(describe(report) if report else "TPU compiler: not run yet for this config (mode=compile)")
    check_fits(plan, cfg)
    hbm = cfg.hardware.hbm_gib_per_chip
    print("plan: fits" + (f" in {hbm:g} GiB HBM per chip" if hbm else ""))
