"""Scan over layers and activation checkpointing (xtrain/xla/layers.py, the model's run_blocks):
the same losses as the unrolled step, on the XLA engine over 4 virtual devices and on the CPU
engine; the planner's account of remat and its "does not fit" levers."""

from __future__ import annotations

import pytest

from conftest import TINY, read_jsonl
from xtrain.errors import ConfigError
from xtrain.plan import memory_levers, resolve
from xtrain.units import GIB

STEPS = 20


def _losses(records):
    return [r["loss"] for r in records if "loss" in r]


@pytest.mark.slow  # about a minute each: four 20-step XLA runs on 4 virtual devices
@pytest.mark.parametrize("parallelism, rows", [("fsdp", 2), ("fsdp_tp", 4)])
def test_scan_and_remat_give_the_unrolled_losses_on_4_devices(parallelism, rows, tmp_path):
    pytest.importorskip("torch_xla")
    from test_xla import common, drive

    variants = {"unrolled": ["model.scan=false"], "scan": ["model.scan=true", "model.remat=false"],
                "scan_remat": ["model.scan=true", "model.remat=true"],
                "remat": ["model.scan=false", "model.remat=true"]}
    jobs = [{"name": name, "dir": str(tmp_path / name), "overrides": common(STEPS) + [
        "hardware.engine=xla", f"parallelism={parallelism}", f"trainer.device_batch_size={rows}",
        "model.depth=3", *extra]} for name, extra in variants.items()]  # 3 layers: 3 scan steps
    results = drive(jobs, 4)
    unrolled = _losses(results["unrolled"]["records"])
    assert len(unrolled) == STEPS and unrolled[-1] < unrolled[0] - 1.0
    for name in ("scan", "scan_remat", "remat"):
        losses = _losses(results[name]["records"])
        worst = max(abs(a - b) / b for a, b in zip(losses, unrolled))
        assert len(losses) == STEPS and worst <= 1e-4, (name, worst, losses, unrolled)
    # the parameters (checkpoint keys) and their shardings do not depend on scan
    assert results["scan"]["summary"]["param_shardings"] == results["unrolled"]["summary"]["param_shardings"]


def test_a_window_pattern_is_scanned_a_period_at_a_time():
    from xtrain.model.config import scan_period

    assert scan_period((None,) * 16) == (1, 16)
    assert scan_period((8, 8, 8, None) * 4) == (4, 4)
    # the last layer is always full: SSL over 7 layers = S S L S S L L -> 2 periods + 1 unrolled
    assert scan_period((8, 8, None, 8, 8, None, None)) == (3, 2)
    assert scan_period((8, None)) == (2, 1)  # nothing repeats: no scan


def test_scan_refuses_layers_sharded_differently(compose_config):
    pytest.importorskip("torch_xla")
    import torch

    from xtrain.model.config import GPTConfig
    from xtrain.model.gpt import GPT
    from xtrain.xla.layers import ScannedBlocks

    cfg = compose_config(["model=d2", "model.vocab_size=512", "model.sequence_len=32"]).model
    cfg.scan = True
    with torch.device("meta"):
        model = GPT(GPTConfig.from_model(cfg, "sdpa"))
    specs = {n: None for n, _ in model.named_parameters()}
    specs["blocks.1.attn.c_q.weight"] = ("fsdp", None)
    with pytest.raises(ConfigError, match=r"model.scan stacks blocks.1.attn.c_q.weight .* set "
                                          r"model.scan=false"):
        ScannedBlocks(model, specs, None, remat=False)


def test_remat_on_the_cpu_engine_gives_the_same_losses(compose_config, tmp_path):
    from xtrain.modes import run

    losses = {}
    for remat in ("false", "true"):
        out = tmp_path / remat
        cfg = compose_config(TINY + ["trainer.max_steps=8", "trainer.log_every=1",
                                     f"model.remat={remat}"], output_dir=str(out))
        run(cfg, str(out))
        losses[remat] = _losses(read_jsonl(out / "metrics.jsonl"))
    assert losses["true"] == losses["false"]  # the same float32 ops, recomputed


def test_scan_is_off_unless_asked_remat_follows_it_and_scan_is_refused_on_the_cpu_engine(compose_config):
    gpt = resolve(compose_config(["hardware=v6e4", "model=d16"]), 4).gpt
    assert gpt.scan is False and gpt.remat is False  # unrolled and fenced: BENCHMARKS.md
    gpt = resolve(compose_config(["hardware=v6e4", "model=d16", "model.scan=true"]), 4).gpt
    assert gpt.scan is True and gpt.remat is True  # remat follows scan unless set
    assert resolve(compose_config(["hardware=v6e4", "model.scan=true", "model.remat=false"]),
                   4).gpt.remat is False
    gpt = resolve(compose_config(["hardware.engine=xla"]), 4).gpt
    assert gpt.scan is False and gpt.remat is False  # XLA on CPU: off unless asked
    with pytest.raises(ConfigError, match="model.scan=true needs the XLA engine"):
        resolve(compose_config(["model.scan=true"]), 1)


def test_planner_counts_remat_and_names_only_the_levers_that_help(compose_config):
    sdpa = ["hardware=v6e4", "model=d16", "data=base_data_v3", "model.attention=sdpa"]
    plain = resolve(compose_config([*sdpa, "model.remat=false"]), 4)
    remat = resolve(compose_config([*sdpa, "model.remat=true"]), 4)
    g, T, B = plain.gpt, 2048, 8
    d = g.n_embd
    per_layer = 2 * (4 * d + 10 * d + 2 * g.kv_dim) + 2 * g.n_head * T  # bf16, sdpa probabilities
    logits = 8 * g.vocab_size
    assert plain.memory.activations == B * T * (g.n_layer * per_layer + logits)
    assert remat.memory.activations == B * T * (g.n_layer * 4 * d + per_layer + logits)
    assert remat.memory.total < plain.memory.total - 10 * GIB
    cfg = compose_config([*sdpa, "model.remat=false"])
    levers = dict(memory_levers(cfg, resolve(cfg, 4)))
    assert "model.remat=true" in levers
    assert levers["model.remat=true"] == remat.memory.total / GIB
    # remat on already: not offered again
    cfg = compose_config([*sdpa, "model.remat=true", "trainer.device_batch_size=64"])
    plan = resolve(cfg, 4)
    assert not plan.memory.fits and "model.remat=true" not in dict(memory_levers(cfg, plan))
