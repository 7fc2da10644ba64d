"""Framework overhead: xtrain's CPU training step (LightningModule + Trainer + callbacks) vs a bare
hand-written PyTorch loop over the same model, optimizer and batch."""

from __future__ import annotations

import time

import torch

COMMAND = "make bench ARGS=step_time   (python -m tests.bench step_time)"
STEPS, WARMUP = 30, 5


def _setup():
    from tests.conftest import compose_cfg
    from xtrain.model.config import GPTConfig
    from xtrain.plan import resolve

    cfg = compose_cfg(["model=d4", "trainer.device_batch_size=8", f"trainer.max_steps={STEPS}",
                       "model.vocab_size=4096"])
    resolve(cfg, 1)
    torch.manual_seed(0)
    batch = torch.randint(0, 4096, (1, 8, cfg.model.sequence_len + 1))
    return cfg, GPTConfig.from_model(cfg.model, "sdpa"), batch


def bare_loop(cfg, gc, batch) -> float:
    from xtrain.model.gpt import GPT
    from xtrain.optim import build_optimizer

    torch.manual_seed(0)
    model = GPT(gc)
    opt = build_optimizer(model, cfg.optim, STEPS)
    times = []
    for _ in range(STEPS):
        t0 = time.perf_counter()
        x, y = batch[0, :, :-1], batch[0, :, 1:]
        loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    return sorted(times[WARMUP:])[len(times[WARMUP:]) // 2]


def framework(cfg, gc, batch) -> float:
    import lightning as L

    from xtrain.compat import quiet_lightning_tpu_probe
    from xtrain.train.module import GPTModule

    class Timer(L.Callback):
        def __init__(self):
            self.times, self.t0 = [], None

        def on_train_batch_start(self, *args):
            self.t0 = time.perf_counter()

        def on_train_batch_end(self, *args):
            self.times.append(time.perf_counter() - self.t0)

    class Repeat(torch.utils.data.IterableDataset):
        def __iter__(self):
            while True:
                yield batch, {}

    torch.manual_seed(0)
    quiet_lightning_tpu_probe()
    module = GPTModule(gc, cfg.optim, STEPS)
    timer = Timer()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=STEPS, logger=False,
                        enable_progress_bar=False, enable_checkpointing=False,
                        enable_model_summary=False, callbacks=[timer], limit_val_batches=0)
    trainer.fit(module, torch.utils.data.DataLoader(Repeat(), batch_size=None))
    return sorted(timer.times[WARMUP:])[len(timer.times[WARMUP:]) // 2]


def run() -> str:
    cfg, gc, batch = _setup()
    torch.set_num_threads(2)
    bares, ours = [], []
    for _ in range(2):  # alternate; each side keeps its best median (noise only adds time)
        bares.append(bare_loop(cfg, gc, batch))
        ours.append(framework(cfg, gc, batch))
    bare, mine = min(bares), min(ours)
    runs = ", ".join(f"{a * 1e3:.0f}/{b * 1e3:.0f}" for a, b in zip(bares, ours))
    return (f"## CPU step time: xtrain vs a bare PyTorch loop\n\n"
            f"`{COMMAND}`: model d4 (vocab 4096), batch 8 x {cfg.model.sequence_len}, Muon+AdamW, "
            f"median of {STEPS - WARMUP} steps after {WARMUP} warm-up; bare and xtrain alternate "
            f"twice and each keeps its best.\n\n"
            f"| run | step time |\n| --- | --- |\n| bare loop | {bare * 1e3:.1f} ms |\n"
            f"| xtrain (Lightning module + Trainer) | {mine * 1e3:.1f} ms |\n\n"
            f"**ratio xtrain / bare = {mine / bare:.3f}** (runs bare/xtrain ms: {runs})\n")
