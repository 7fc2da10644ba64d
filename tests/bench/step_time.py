"""Framework overhead: xtrain's CPU training step (LightningModule + Trainer + callbacks) vs a bare
hand-written PyTorch loop over the same model, optimizer and batch. Both record their per-step
losses, which must be equal (bitwise) before the ratio is reported."""

from __future__ import annotations

import time

import torch

from tests.bench.targets import same_losses, target

COMMAND = "make bench ARGS=step_time   (python -m tests.bench step_time)"
STEPS, WARMUP = 30, 5
RATIO_TARGET = 1.05


def _setup():
    from tests.conftest import compose_cfg
    from xtrain.model.config import GPTConfig
    from xtrain.plan import resolve

    cfg = compose_cfg(["model=d4", "trainer.device_batch_size=8", f"trainer.max_steps={STEPS}",
                       "model.vocab_size=4096"])
    resolve(cfg, 1)
    torch.manual_seed(0)
    # xtrain's layout [rows, micro-batches, T+1]: 8 rows in one micro-batch, as the bare loop
    # takes them (8 micro-batches of one row would be gradient accumulation, other work)
    batch = torch.randint(0, 4096, (8, 1, cfg.model.sequence_len + 1))
    return cfg, GPTConfig.from_model(cfg.model, "sdpa"), batch


def bare_loop(cfg, gc, batch) -> dict:
    from xtrain.model.gpt import GPT
    from xtrain.optim import build_optimizer

    torch.manual_seed(0)
    model = GPT(gc)
    opt = build_optimizer(model, cfg.optim, STEPS)
    times, losses = [], []
    for _ in range(STEPS):
        t0 = time.perf_counter()
        x, y = batch[:, 0, :-1], batch[:, 0, 1:]
        loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())  # after the timer: the step is already done (eager CPU)
    return {"times": times, "losses": losses}


def framework(cfg, gc, batch) -> dict:
    import lightning as L

    from tests.bench.probe import StepProbe
    from xtrain.compat import quiet_lightning_tpu_probe
    from xtrain.train.module import GPTModule

    class Repeat(torch.utils.data.IterableDataset):
        def __iter__(self):
            while True:
                yield batch, {}

    torch.manual_seed(0)
    quiet_lightning_tpu_probe()
    module = GPTModule(gc, cfg.optim, STEPS)
    timer = StepProbe()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=STEPS, logger=False,
                        enable_progress_bar=False, enable_checkpointing=False,
                        enable_model_summary=False, callbacks=[timer], limit_val_batches=0)
    trainer.fit(module, torch.utils.data.DataLoader(Repeat(), batch_size=None))
    return {"times": timer.times, "losses": timer.losses}


def _median(times) -> float:
    timed = sorted(times[WARMUP:])
    return timed[len(timed) // 2]


def run() -> str:
    cfg, gc, batch = _setup()
    torch.set_num_threads(2)
    bares, ours = [], []
    for _ in range(2):  # alternate; each side keeps its best median (noise only adds time)
        bares.append(bare_loop(cfg, gc, batch))
        ours.append(framework(cfg, gc, batch))
    for b, o in zip(bares, ours):
        same_losses("step_time: xtrain vs bare", o["losses"], b["losses"])
    bares, ours = [_median(r["times"]) for r in bares], [_median(r["times"]) for r in ours]
    bare, mine = min(bares), min(ours)
    ok = target(mine / bare <= RATIO_TARGET, "step_time: xtrain / bare")
    runs = ", ".join(f"{a * 1e3:.0f}/{b * 1e3:.0f}" for a, b in zip(bares, ours))
    return (f"## CPU step time: xtrain vs a bare PyTorch loop\n\n"
            f"`{COMMAND}`: model d4 (vocab 4096), batch 8 x {cfg.model.sequence_len}, Muon+AdamW, "
            f"median of {STEPS - WARMUP} steps after {WARMUP} warm-up; bare and xtrain alternate "
            f"twice and each keeps its best. Losses of every step checked equal first "
            f"(bitwise, every run).\n\n"
            f"| run | step time |\n| --- | --- |\n| bare loop | {bare * 1e3:.1f} ms |\n"
            f"| xtrain (Lightning module + Trainer) | {mine * 1e3:.1f} ms |\n\n"
            f"**ratio xtrain / bare = {mine / bare:.3f}** (target <= {RATIO_TARGET}: {ok}; "
            f"runs bare/xtrain ms: {runs})\n")
