"""Hardware profiles, the preflight planner (batch, memory, time, cost) and its refusals."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from xtrain.cli import config_dir
from xtrain.errors import EXIT_REFUSED, ConfigError
from xtrain.hardware import check_profile
from xtrain.plan import check_fits, resolve
from xtrain.preflight.targets import topology_kwargs
from xtrain.units import GIB
from xtrain.xla.runtime import runtime_mismatches

TPU_PROFILES = sorted(p.stem for p in (Path(config_dir()) / "hardware").glob("v*.yaml"))
REAL_RUNS = {  # (hardware, data): the real runs' configs
    "v5e8-1024": ["hardware=v5e8", "data=base_data_v3"],
    "v6e4-2048": ["hardware=v6e4", "data=base_data_v3"],
    "v6e4-16k": ["hardware=v6e4", "data=cpp16k"],
}


def _plan(compose_config, *overrides, devices=None):
    cfg = compose_config(["model=d16", "trainer.total_batch_size=524288", *overrides])
    return cfg, resolve(cfg, devices or cfg.hardware.chips)


def test_tpu_facts(compose_config):
    facts = {name: compose_config([f"hardware={name}"]).hardware for name in TPU_PROFILES}
    assert (facts["v4_32"].chips, facts["v4_32"].hosts, facts["v4_32"].cores_per_chip) == (16, 4, 2)
    assert (facts["v4_64"].chips, facts["v4_64"].hosts) == (32, 8)
    assert (facts["v6e8"].chips, facts["v6e8"].hosts) == (8, 1)  # v6e-8 is one host
    assert (facts["v5e8"].hbm_gib_per_chip, facts["v5e8"].peak_bf16_tflops_per_chip) == (16, 197)
    assert (facts["v6e4"].hbm_gib_per_chip, facts["v6e4"].peak_bf16_tflops_per_chip) == (32, 918)
    for hw in facts.values():
        check_profile(hw)
        assert hw.engine == "xla" and hw.env.PJRT_DEVICE == "TPU" and hw.env.XLA_NO_SPECIAL_SCALARS == "1"
        assert dict(hw.pins) == {"torch": "2.9.1", "torch_xla": "2.9.0", "libtpu": "0.0.21",
                                 "jax": "0.7.0", "jaxlib": "0.7.0", "flax": "0.11.2"}


def test_the_tpu_extra_installs_exactly_the_profiles_pins(compose_config):
    """pip install 'xtrain[tpu]' must give the stack the TPU profiles check at start."""
    import tomllib

    pyproject = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    extras = pyproject["project"]["optional-dependencies"]
    extra = dict(r.split("==") for r in extras["tpu"])
    pins = compose_config(["hardware=v6e4"]).hardware.pins
    assert extra == {p: str(v) for p, v in pins.items() if p not in ("torch", "torch_xla")}


@pytest.mark.parametrize("name, seq, batch", [("v5e8-1024", 1024, 8), ("v6e4-2048", 2048, 8),
                                              ("v6e4-16k", 16384, 1)])
def test_user_batch_arithmetic_reproduces(name, seq, batch, compose_config):
    cfg, plan = _plan(compose_config, *REAL_RUNS[name])
    assert (cfg.model.sequence_len, cfg.trainer.device_batch_size) == (seq, batch)
    assert plan.batch.grad_accum_steps == 8 and plan.batch.total_batch_size == 524_288


# Hand-computed per-chip memory for d16 (d=1024, 16 layers, 8 heads, V=65536, bf16, replicated):
# weights = grads = 335,544,320 params x 4 B = 1,342,177,280 B (1.25 GiB)
# optimizer = (wte + lm_head) 134,217,728 x 8 B + matrices 201,326,592 x 4 B = 1,879,048,192 B
# activations per token: 16 layers x 2 B x (4d + 10d + 2d) = 524,288 B; sdpa probabilities
#   16 x 2 B x 8 heads x T; logits 8 B x 65536 = 524,288 B.
HAND_MEMORY = {
    "v5e8-1024": 1_342_177_280 * 2 + 1_879_048_192 + 8 * 1024 * (524_288 + 16 * 2 * 8 * 1024 + 524_288),
    "v6e4-2048": 1_342_177_280 * 2 + 1_879_048_192 + 8 * 2048 * (524_288 + 524_288),  # flash
    "v6e4-16k": 1_342_177_280 * 2 + 1_879_048_192 + 1 * 16384 * (524_288 + 524_288),  # flash
}


@pytest.mark.parametrize("name", sorted(HAND_MEMORY))
def test_memory_estimate_matches_hand_computation(name, compose_config):
    # as the real runs trained: without activation checkpointing (its account: tests/test_scan.py)
    _, plan = _plan(compose_config, *REAL_RUNS[name], "model.remat=false")
    assert plan.memory.total == HAND_MEMORY[name]
    assert plan.memory.fits  # all three run on real TPUs today
    assert plan.attention == ("sdpa" if name == "v5e8-1024" else "flash")


def test_fsdp_divides_state_by_the_fsdp_axis(compose_config):
    _, dp = _plan(compose_config, "hardware=v6e4", "data=base_data_v3")
    _, fsdp = _plan(compose_config, "hardware=v6e4", "data=base_data_v3", "parallelism=fsdp")
    assert fsdp.mesh == {"data": 1, "fsdp": 4, "tensor": 1}
    assert fsdp.memory.weights == dp.memory.weights / 4
    assert fsdp.memory.optimizer == dp.memory.optimizer / 4
    assert fsdp.memory.activations == dp.memory.activations


def test_time_and_cost_at_the_assumed_mfu(compose_config):
    cfg, plan = _plan(compose_config, *REAL_RUNS["v6e4-2048"], "trainer.max_steps=1000")
    expected = plan.flops_per_token * 524_288 / (4 * 918e12 * cfg.hardware.expected_mfu)
    assert plan.step_seconds == pytest.approx(expected)
    text = plan.describe()
    hours = expected * 1000 / 3600
    assert f"${hours * 1.70:,.2f} spot" in text and f"${hours * 5.10:,.2f} on demand" in text


def test_model_that_cannot_fit_is_refused_with_the_numbers(compose_config):
    _, plan = _plan(compose_config, "hardware=v5e8", "data=cpp16k", "model=d26")
    assert not plan.memory.fits and plan.memory.total > 16 * GIB
    with pytest.raises(ConfigError, match=r"does not fit: memory/chip: .* of 16 GiB HBM"):
        check_fits(plan)


def test_plan_command_prints_the_reason(tmp_path):
    r = subprocess.run([sys.executable, "-m", "xtrain", "hardware=v5e8", "model=d26", "data=cpp16k",
                        "mode=plan", f"hydra.run.dir={tmp_path}"], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2
    assert "parameters: 1,081,999,360" in r.stdout and "memory/chip:" in r.stdout
    # depth 26 x aspect ratio 64 = width 1664, in heads of 128; cpp16k: 16K context, 64K vocab
    assert ("model: 26 layers, width 1664, 13 heads of 128 (13 for keys and values), vocab 65,536, "
            "context 16,384") in r.stdout
    assert "does not fit" in r.stderr
    code = ("import sys; sys.argv=['xtrain','hardware=v6e4','model=d16','data=cpp16k','mode=plan',"
            f"'hydra.run.dir={tmp_path}']\nimport xtrain.cli as c\n"
            "try:\n    c.main()\nexcept SystemExit:\n    pass\nassert 'torch' not in sys.modules\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "plan: fits in 32 GiB" in r.stdout, r.stderr


def test_a_cpu_plan_says_whether_it_fits_this_machine(tmp_path):
    """The CPU engine has no HBM: its estimate is held against this machine's memory. Activations
    are an upper bound there (the fused loss holds no logits), so a total past it is said, not
    refused; 65,536 rows of 2,048 tokens are past any machine's."""
    big = ["model=d2", "model.sequence_len=2048", "trainer.device_batch_size=65536",
           "trainer.total_batch_size=134217728"]
    plans = {}
    for name, overrides in (("small", ["model=d2"]), ("big", big)):
        r = subprocess.run([sys.executable, "-m", "xtrain", "mode=plan", *overrides,
                            f"hydra.run.dir={tmp_path}/{name}"], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr[-3000:]
        plans[name] = r.stdout
    assert "plan: fits in this machine's memory" in plans["small"]
    total = re.search(r"memory/chip: ([\d.]+) GiB", plans["big"])[1]
    assert re.search(rf"plan: may not fit this machine: {total} GiB estimated for 1 process\(es\) here "
                     r"\(an upper bound: the activations'\), [\d.]+ GiB available", plans["big"]), plans["big"]


def test_xla_on_cpu_counts_each_virtual_devices_share_against_this_machine(tmp_path,
                                                                           compose_config):
    """XLA on CPU runs every virtual device in one process, each holding its own share of the
    state (here replicated: the whole of it). A device count whose copies of the weights,
    gradients and optimizer state exceed this machine's memory is refused, though one copy fits
    (it planned as fitting)."""
    from xtrain.hardware import available_bytes

    overrides = ["hardware.engine=xla", "model=d12", "trainer.device_batch_size=1"]
    memory = resolve(compose_config(overrides), 1).memory  # (replicated: the same per device)
    state = memory.weights + memory.grads + memory.optimizer
    devices = int(available_bytes() // state) + 2  # one copy fits, these do not
    assert state * 2 < available_bytes()
    r = subprocess.run([sys.executable, "-m", "xtrain", "mode=plan", *overrides,
                        f"trainer.total_batch_size={devices * 2048}", f"hydra.run.dir={tmp_path}"],
                       capture_output=True, text=True, timeout=60,
                       env={**os.environ, "CPU_NUM_DEVICES": str(devices)})
    assert r.returncode == EXIT_REFUSED, r.stdout[-2000:] + r.stderr[-2000:]
    assert f"x {devices} virtual XLA device(s) here: the weights, gradients and optimizer state " \
        "alone take" in r.stderr, r.stderr


@pytest.mark.parametrize("overrides, message", [
    (["hardware=v6e1", "parallelism=fsdp_tp"], "1 devices do not divide by the fixed axes"),
    (["hardware=v6e4", "parallelism.data=3"], "mesh data=3 x fsdp=1 x tensor=1 = 3 devices, but the hardware has 4"),
    (["hardware=v6e4", "parallelism.data=-1", "parallelism.fsdp=-1"], "at most one -1"),
    (["hardware=v6e4", "+parallelism.rules=[[wte,[pipeline,null]]]"], "mesh axis 'pipeline'"),
    (["hardware=v5e8", "trainer.total_batch_size=100000"], "is not a multiple of"),
    (["hardware=v6e4", "hardware.accelerator_type=v9x-4"], "unknown TPU type"),
    (["hardware=v4_32", "hardware.chips=32"], r"v4-32 has 16 chips \(cores counted in the name\)"),
    (["hardware=v6e4", "hardware.topology=null"], "is missing hardware.topology"),
    (["hardware=v6e4", "hardware.hbm_gib_per_chip=0"], "is missing hardware.hbm_gib_per_chip"),
])
def test_preflight_refusals(overrides, message, compose_config):
    cfg = compose_config(["model=d16", "data=base_data_v3", *overrides])
    with pytest.raises(ConfigError, match=message):
        resolve(cfg, cfg.hardware.chips)


def test_runtime_mismatch_is_refused_not_silently_run_on_cpu(compose_config):
    hw = compose_config(["hardware=v6e4"]).hardware
    good = {"torch": "2.9.1", "torch_xla": "2.9.0", "libtpu": "0.0.21", "jax": "0.7.0", "jaxlib": "0.7.0"}
    assert runtime_mismatches(hw, "TPU", 4, good) == []
    problems = runtime_mismatches(hw, "CPU", 1, {**good, "jax": "0.7.1"})
    assert any("the XLA runtime is CPU, hardware=v6e4 needs TPU" in p for p in problems)
    assert any("1 devices visible" in p for p in problems)
    assert any("jax==0.7.1 installed, hardware=v6e4 pins 0.7.0" in p for p in problems)


TOPOLOGY_CHILD = r"""
import json, os, sys
os.environ["TPU_SKIP_MDS_QUERY"] = "1"   # compile-only: no TPU metadata server
os.environ.pop("JAX_PLATFORMS", None)
from jax.experimental import topologies
out = {}
for arg in sys.argv[1:]:
    kwargs = json.loads(arg)
    t = topologies.get_topology_desc(**kwargs)
    out[kwargs["topology_name"]] = [len(t.devices), t.devices[0].device_kind,
                                    len({d.process_index for d in t.devices})]
print(json.dumps(out))
"""


def test_topologies_are_known_to_the_tpu_compiler(compose_config):
    pytest.importorskip("libtpu", reason="the tpu extra (libtpu 0.0.21) is not installed")
    hws = {name: compose_config([f"hardware={name}"]).hardware for name in TPU_PROFILES}
    args = [json.dumps(topology_kwargs(hw)) for hw in hws.values()]
    env = {k: v for k, v in os.environ.items() if not k.startswith("TPU_ACCELERATOR")}
    env["ALLOW_MULTIPLE_LIBTPU_LOAD"] = "1"  # other compile-only clients may be running
    # libtpu can abort its process: it runs in a child
    r = subprocess.run([sys.executable, "-c", TOPOLOGY_CHILD, *args], capture_output=True, text=True,
                       timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    found = json.loads(r.stdout.strip().splitlines()[-1])
    kinds = {"v4": "TPU v4", "v5e": "TPU v5 lite", "v5p": "TPU v5", "v6e": "TPU v6 lite"}
    for hw in hws.values():
        devices, kind, hosts = found[hw.topology]
        assert kind == kinds[hw.topology.split(":")[0]]
        # one compile device per chip, as torch_xla sees them (v4/v5p in megacore mode), on
        # the profile's hosts (libtpu's default made a v5e-8 and a v6e-8 two hosts of 4)
        assert (devices, hosts) == (hw.chips, hw.hosts), hw.name


def test_profile_environment_is_exported_and_user_values_win(compose_config, monkeypatch):
    from xtrain.xla.runtime import apply_environment

    hw = compose_config(["hardware=v6e4"]).hardware
    # setenv first, so monkeypatch restores the environment (a leaked PJRT_DEVICE=TPU would make
    # later tests start libtpu)
    monkeypatch.setenv("PJRT_DEVICE", "unset")
    monkeypatch.delenv("PJRT_DEVICE")
    monkeypatch.setenv("XLA_NO_SPECIAL_SCALARS", "0")  # set explicitly: kept
    monkeypatch.setenv("LIBTPU_INIT_ARGS", "")  # the compiler's flags, replaced as a whole
    applied = apply_environment(hw)
    assert os.environ["PJRT_DEVICE"] == "TPU" and applied == {"PJRT_DEVICE": "TPU"}
    assert os.environ["XLA_NO_SPECIAL_SCALARS"] == "0" and os.environ["LIBTPU_INIT_ARGS"] == ""


def test_the_headline_command_plans_the_real_run(compose_config):
    """TPU profiles train 524,288-token steps for 20 tokens per parameter unless told otherwise."""
    cfg = compose_config(["hardware=v6e4", "model=d16", "data=cpp16k"])
    plan = resolve(cfg, 4)
    assert plan.batch.total_batch_size == 524_288
    assert (plan.batch.device_batch_size, plan.batch.sequence_len, plan.batch.grad_accum_steps) == (1, 16384, 8)
    assert plan.max_steps == 12_800  # ceil(20 x 335,544,320 / 524,288)
    assert "steps: 12,800 x 524,288 tokens" in plan.describe()
    assert "(20.00 tokens/param)" in plan.describe()
    cpu = resolve(compose_config([]), 1)  # the CPU default stays a few-minute job
    assert (cpu.max_steps, cpu.batch.total_batch_size) == (200, 2048)


PRESETS = sorted(p.stem for p in (Path(config_dir()) / "experiment").glob("[!_]*.yaml"))


@pytest.mark.parametrize("preset", PRESETS)
def test_every_experiment_preset_composes_and_plans(preset, compose_config):
    cfg = compose_config([f"+experiment={preset}"])
    plan = resolve(cfg, cfg.hardware.chips)
    assert plan.batch.total_batch_size == 524_288 and plan.batch.grad_accum_steps == 8
    assert plan.max_steps == 50_000  # the presets reproduce runs of 50,000 steps
    check_fits(plan, cfg)
    # as those runs (their notes: --save_every --sample_every --core_metric_every=5000 and
    # checkpoints in the bucket): a spot VM's disk goes with it
    assert (cfg.checkpoint.every, cfg.trainer.sample_every, cfg.eval.cpp_every) == (5000,) * 3
    assert cfg.checkpoint.dir == f"gs://nanochat-training-data-2026/checkpoints/{cfg.run.name}"


@pytest.mark.parametrize("preset", sorted(p.stem for p in (Path(config_dir()) / "debug").glob("*.yaml")))
def test_every_debug_preset_composes_and_plans(preset, compose_config):
    cfg = compose_config([f"+debug={preset}"])
    plan = resolve(cfg, 1)
    assert plan.max_steps <= 100 and cfg.trainer.max_compiles == 1


def test_does_not_fit_names_only_levers_that_help(compose_config):
    cfg = compose_config(["hardware=v6e4", "model=d16", "data=base_data_v3", "model.attention=sdpa",
                          "trainer.device_batch_size=16", "model.remat=false"])
    plan = resolve(cfg, 4)
    with pytest.raises(ConfigError) as refused:
        check_fits(plan, cfg)
    message = str(refused.value)
    # halving the batch to 8 removes 8 x 2048 tokens of activations (24 GiB of 48): planner arithmetic
    assert "trainer.device_batch_size=8 -> 28.25 GiB;" in message
    assert "model.attention=flash -> 36.25 GiB (still too much)" in message
    cfg = compose_config(["hardware=v5e8", "model=d26", "data=cpp16k"])  # batch 1, flash already
    with pytest.raises(ConfigError) as refused:
        check_fits(resolve(cfg, 8), cfg)
    assert "device_batch_size" not in str(refused.value) and "model.attention" not in str(refused.value)
