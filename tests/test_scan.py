"""Scan over layers and activation checkpointing (xtrain/xla/layers.py, the model's run_blocks):
the same losses as the unrolled step, on the XLA engine over 4 virtual devices and on the CPU
engine; the fence between a scanned step's micro-batches; the planner's account of remat and its
"does not fit" levers."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from conftest import TINY, read_jsonl
from xtrain.errors import ConfigError
from xtrain.plan import memory_levers, resolve
from xtrain.units import GIB

STEPS = 20


def _losses(records):
    return [r["loss"] for r in records if "loss" in r]


@pytest.mark.slow  # about a minute each: four 20-step XLA runs on 4 virtual devices
@pytest.mark.parametrize("parallelism, rows, accum", [("fsdp", 2, 1), ("fsdp_tp", 4, 1), ("fsdp", 1, 3)])
def test_scan_and_remat_give_the_unrolled_losses_on_4_devices(parallelism, rows, accum, tmp_path):
    """Scanned, checkpointed and unrolled runs: the same losses and as many compiled graphs;
    with accumulation, their micro-batches fenced (xtrain/engines/step.py)."""
    pytest.importorskip("torch_xla")
    from test_xla import SEQ, batch_parallel, common, drive

    variants = {"unrolled": ["model.scan=false"], "scan": ["model.scan=true", "model.remat=false"],
                "scan_remat": ["model.scan=true", "model.remat=true"],
                "remat": ["model.scan=false", "model.remat=true"]}
    tokens = rows * batch_parallel(parallelism, 4) * SEQ * accum  # per step
    jobs = [{"name": name, "dir": str(tmp_path / name), "overrides": common(STEPS) + [
        "hardware.engine=xla", f"parallelism={parallelism}", f"trainer.device_batch_size={rows}",
        f"trainer.total_batch_size={tokens}", "model.depth=3", *extra]}
        for name, extra in variants.items()]  # 3 layers: 3 scan steps
    results = drive(jobs, 4)
    records = {name: [r for r in results[name]["records"] if "loss" in r] for name in variants}
    assert [r["tokens"] for r in records["unrolled"]] == [s * tokens for s in range(1, STEPS + 1)]
    unrolled = _losses(records["unrolled"])
    assert len(unrolled) == STEPS and unrolled[-1] < unrolled[0] - 1.0
    for name in ("scan", "scan_remat", "remat"):
        losses = _losses(records[name])
        worst = max(abs(a - b) / b for a, b in zip(losses, unrolled))
        assert len(losses) == STEPS and worst <= 1e-4, (name, worst, losses, unrolled)
        assert _new_compiles(records[name]) == _new_compiles(records["unrolled"]), name
    # the parameters (checkpoint keys) and their shardings do not depend on scan
    assert results["scan"]["summary"]["param_shardings"] == results["unrolled"]["summary"]["param_shardings"]


def _new_compiles(records) -> list[int]:
    """XLA compilations since the first logged step, at each logged step (scan's tracing compiles
    its own small graphs once, at the first step)."""
    return [r["xla_compiles"] - records[0]["xla_compiles"] for r in records]


def _depends_on(lines: list[str]) -> dict[str, set[str]]:
    """SSA value -> the values it is computed from, in a StableHLO function's lines."""
    deps: dict[str, set[str]] = {}
    for line in lines:
        m = re.match(r"\s*(%[\w.]+)(?::\d+)? = (.*)", line)
        if m:
            deps[m.group(1)] = set(re.findall(r"(%[\w.]+)", m.group(2)))
    return deps


def _upstream(deps: dict[str, set[str]], value: str) -> set[str]:
    """Every value ``value`` is computed from, directly or not."""
    seen, todo = set(), [value]
    while todo:
        for d in deps.get(todo.pop(), ()):
            if d not in seen:
                seen.add(d)
                todo.append(d)
    return seen


def test_scanned_micro_batches_are_fenced_without_copying_the_earlier_ones(compose_config, tmp_path):
    """The traced step of scanned blocks with 3 micro-batches: a barrier before each one after
    the first, whose results every later scan loop waits for, and one forward and one backward
    loop per micro-batch; a barrier upstream of a scan's carry made torch_xla copy the earlier
    micro-batches, loops included, into each later loop body (xtrain/xla/layers.py
    ScannedBlocks.fence)."""
    pytest.importorskip("torch_xla")
    from xtrain.preflight.runner import trace

    accum = 3
    cfg = compose_config(["hardware=v6e4", "model=d2", "model.sequence_len=256", "data=cpp16k",
                          "trainer.device_batch_size=2", f"trainer.total_batch_size={2048 * accum}",
                          "model.scan=true", "mode=compile"])
    plan = resolve(cfg, 4)
    assert plan.batch.grad_accum_steps == accum
    # and, after them, Muon's Newton-Schulz loop of each shape of matrix (xtrain/optim.py)
    muon_shapes = len({s for n, s in plan.gpt.param_shapes().items() if n.startswith("blocks.")})
    trace(cfg, str(tmp_path))
    text = Path(tmp_path, "step.mlir").read_text()
    assert text.count("stablehlo.while") == 2 * accum + muon_shapes
    main = text.split("func.func private", 1)[0].splitlines()
    deps = _depends_on(main)
    barriers = [re.match(r"\s*(%[\w.]+)", ln).group(1) for ln in main if "optimization_barrier" in ln]
    assert len(barriers) == accum - 1
    loops = [re.match(r"\s*(%[\w.]+)", ln).group(1) for ln in main if "call @scan" in ln]
    assert len(loops) == 2 * accum + muon_shapes
    loops = loops[:2 * accum]

    fenced_by = [sum(b in _upstream(deps, loop) for b in barriers) for loop in loops]
    # in program order: forward and backward of micro-batch 0, of micro-batch 1, ...
    assert fenced_by == [k // 2 for k in range(2 * accum)]


def test_a_window_pattern_is_scanned_a_period_at_a_time():
    from xtrain.model.config import scan_period

    assert scan_period((None,) * 16) == (1, 16)
    assert scan_period((8, 8, 8, None) * 4) == (4, 4)
    # the last layer is always full: SSL over 7 layers = S S L S S L L -> 2 periods + 1 unrolled
    assert scan_period((8, 8, None, 8, 8, None, None)) == (3, 2)
    assert scan_period((8, None)) == (2, 1)  # nothing repeats: no scan


TAIL_FORWARDS = """
import sys
import torch, torch_xla
from xtrain.model.config import GPTConfig
from xtrain.model.gpt import GPT
from xtrain.xla.layers import install_layer_loop
remat = sys.argv[1] == "true"
config = GPTConfig(n_layer=5, n_head=2, n_kv_head=2, n_embd=64, vocab_size=64, sequence_len=16,
                   windows=(8, None, 8, None, None), attention="sdpa", attention_block=16,
                   softcap=15.0, scan=True, remat=remat)  # SL over 5 layers: 2 periods + 1
model = GPT(config).to(torch_xla.device())
install_layer_loop(model, None, None)
tail, forwards = model.blocks[4], []
tail.register_forward_pre_hook(lambda module, args: forwards.append(1))  # (reentrant: its first
# forward runs without grad, the one in backward with it)
ids = torch.randint(0, 64, (2, 16)).to(torch_xla.device())
model(ids, ids).backward()
torch_xla.sync()
print(len(forwards))
"""


@pytest.mark.parametrize("remat", ["false", "true"])
def test_the_layers_after_the_scanned_periods_are_checkpointed_with_remat(remat):
    """A window pattern whose period leaves layers after the scan (SL over 5 layers: 1; SSSL over
    26: 2): with remat those are checkpointed too (their forward runs again in backward), as the
    planner counts them; they kept every activation. A child process: XLA on CPU."""
    pytest.importorskip("torch_xla")
    import os
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", TAIL_FORWARDS, remat], capture_output=True,
                          text=True, timeout=300, cwd=Path(__file__).resolve().parent.parent,
                          env={**os.environ, "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert int(done.stdout.split()[-1]) == (2 if remat == "true" else 1), done.stdout


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
    """model.remat=true checkpoints each block: its forward starts again in backward (counted
    by a forward pre-hook on every Block, with grad enabled: validation runs without; a post-hook
    would miss it, the recomputation stops once it has what backward needs), and the losses are
    those of the plain run."""
    import torch

    from xtrain.model.gpt import Block
    from xtrain.modes import run

    losses, forwards = {}, {}

    def count(module, args):
        if isinstance(module, Block) and torch.is_grad_enabled():
            forwards[remat] += 1

    hook = torch.nn.modules.module.register_module_forward_pre_hook(count)
    try:
        for remat in ("false", "true"):
            forwards[remat] = 0
            out = tmp_path / remat
            cfg = compose_config(TINY + ["trainer.max_steps=8", "trainer.log_every=1",
                                         f"model.remat={remat}"], output_dir=str(out))
            run(cfg, str(out))
            losses[remat] = _losses(read_jsonl(out / "metrics.jsonl"))
    finally:
        hook.remove()
    assert len(losses["false"]) == 8
    assert losses["true"] == losses["false"]  # the same float32 ops, recomputed
    # 8 steps of one micro-batch through d2's 2 blocks; remat runs each block again in backward
    assert forwards == {"false": 8 * 2, "true": 2 * 8 * 2}


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
