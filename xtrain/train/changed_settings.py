"""What a resumed run trains with differently from its checkpoint, named in warnings: the
config's values apply (the optimizer's own group settings, lr, betas, ..., are named by
xtrain/optim.py ``MuonAdamW.load_state_dict``)."""

from __future__ import annotations

from xtrain.errors import warn

# optim.* settings that no optimizer group holds: the schedule and the clipping
OUTSIDE_THE_GROUPS = ("warmup_steps", "warmdown_ratio", "final_lr_frac", "grad_clip")


def warn_changed_settings(resume_from: str, meta: dict, step: int, cfg, plan) -> None:
    """``meta``: the checkpoint's (its config as trained); ``step``: where training resumes."""
    max_steps, tokens = plan.max_steps, plan.batch.total_batch_size
    if meta.get("max_steps") not in (None, max_steps) and step < max_steps:
        warn(f"{resume_from} was trained toward step {meta['max_steps']}, this run toward step "
             f"{max_steps} (trainer.max_steps): the learning rate follows the new length's "
             f"schedule (warmup, warmdown) from step {step} on")
    if meta.get("total_batch_size") not in (None, tokens):
        warn(f"{resume_from} was trained at {meta['total_batch_size']:,} tokens per step, this "
             f"run trains at {tokens:,} (trainer.total_batch_size, the devices' batch): the "
             "steps that remain see that many tokens each")
    saved = ((meta.get("config") or {}).get("optim")) or {}
    changed = [f"optim.{k} {saved[k]} -> {cfg.optim[k]}" for k in OUTSIDE_THE_GROUPS
               if k in saved and saved[k] != cfg.optim[k]]
    if changed:
        warn(f"{resume_from} was trained with other settings, this run's apply from step {step} "
             "on: " + "; ".join(changed))
