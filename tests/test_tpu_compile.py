"""The TPU preflight: the training step and the Pallas attention kernels compile for the target
TPU topology with libtpu, on this CPU (no TPU)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import compose_cfg
from xtrain.plan import resolve
from xtrain.preflight.report import collective_summary, hbm_from_error
from xtrain.preflight.runner import compile_kernel, compile_step, run_preflight
from xtrain.preflight.targets import kernel_requests, trace_environment


@pytest.fixture
def v6e4_16k(compose_config):
    cfg = compose_config(["hardware=v6e4", "model=d16", "data=cpp16k", "model.window_pattern=SSSL",
                          "model.window_len=1024"])
    plan = resolve(cfg, 4)
    return cfg, plan


def test_requests_cover_flash_and_the_windowed_splash_layers(v6e4_16k):
    cfg, plan = v6e4_16k
    reqs = kernel_requests(cfg.hardware, plan.gpt, 1)
    assert plan.attention == "flash"
    assert [(r["kernel"], r["window"]) for r in reqs] == [("flash", None), ("splash", 1024)]
    assert reqs[0]["shape"] == [1, 8, 16384, 128]
    assert reqs[0]["topology"] == {"platform": "tpu", "topology_name": "v6e:2x2",
                                   "chips_per_host_bounds": (2, 2, 1)}  # one host: the whole slice


def test_sdpa_configs_need_no_kernel(compose_config):
    cfg = compose_config(["hardware=v5e8", "model=d16", "data=base_data_v3"])
    plan = resolve(cfg, 8)
    assert kernel_requests(cfg.hardware, plan.gpt, 8) == []


def test_kernels_compile_for_v6e_with_the_pinned_jax_and_libtpu(v6e4_16k):
    pytest.importorskip("libtpu", reason="the tpu extra (libtpu 0.0.21) is not installed")
    cfg, plan = v6e4_16k
    for req in kernel_requests(cfg.hardware, plan.gpt, 1):
        req["shape"][2] = 2048  # the real kernels at a shorter length keep the test quick
        if req["window"]:
            req["window"] = 512
        result = compile_kernel(req)
        assert result["ok"], result
        assert result["jax"] == "0.7.0" and result["argument_bytes"] > 0


def test_a_compiler_failure_is_reported_not_raised(v6e4_16k):
    pytest.importorskip("libtpu", reason="the tpu extra (libtpu 0.0.21) is not installed")
    cfg, plan = v6e4_16k
    (req, *_) = kernel_requests(cfg.hardware, plan.gpt, 1)
    req["topology"]["topology_name"] = "v6e:3x3x3"  # no such slice
    result = compile_kernel(req)
    assert result["ok"] is False and 'Topology layout "v6e:3x3x3"' in result["error"]  # libtpu's words


def test_a_compile_child_out_of_host_memory_gives_no_verdict(tmp_path):
    """Python's MemoryError in the compile child (here a real one: the child runs under an
    address-space limit and reads a 6 GiB StableHLO file) is the machine's limit, not the
    compiler's answer about the config: the report is not cached as the config's verdict."""
    pytest.importorskip("libtpu", reason="the tpu extra (libtpu 0.0.21) is not installed")
    from xtrain.preflight.report import answered

    stablehlo = tmp_path / "step.mlir"
    with open(stablehlo, "wb") as f:  # sparse: no disk used
        f.truncate(6 * 2**30)
    limited = tmp_path / "python"
    limited.write_text(f'#!/bin/sh\nulimit -v 3000000\nexec "{sys.executable}" "$@"\n')
    limited.chmod(0o755)
    request = {"topology": {"platform": "tpu", "topology_name": "v6e:2x2"}, "devices": 4,
               "stablehlo": str(stablehlo)}
    result = compile_step(request, python=str(limited))
    assert result["ok"] is False and "ran out of host memory (MemoryError)" in result["error"], result
    assert result["answered"] is False and not answered({"step": result, "kernels": []})
    # the same child without the limit reaches the file and answers (a config it cannot read)
    stablehlo.unlink()
    assert compile_step(request)["answered"] is True


def test_the_compiler_gets_the_runs_libtpu_flags(compose_config, monkeypatch):
    """The profile's libtpu flags reach the compiler child (libtpu refuses an unknown one in its
    own words); a LIBTPU_INIT_ARGS in the environment wins over them, as it does for the run."""
    pytest.importorskip("libtpu", reason="the tpu extra (libtpu 0.0.21) is not installed")
    from xtrain.hardware import libtpu_init_args

    monkeypatch.delenv("LIBTPU_INIT_ARGS", raising=False)
    cfg = compose_config(["hardware=v6e4", "model=d16", "data=cpp16k",
                          "hardware.env.LIBTPU_INIT_ARGS='--xla_no_such_flag=true'"])
    hw = cfg.hardware
    assert libtpu_init_args(hw, {"LIBTPU_INIT_ARGS": "--xla_tpu_x=1"}) == "--xla_tpu_x=1"
    assert libtpu_init_args(hw, {"LIBTPU_INIT_ARGS": ""}) == ""  # set, even empty: it wins
    (req, *_) = kernel_requests(hw, resolve(cfg, 4).gpt, 1)
    req["shape"][2] = 2048
    result = compile_kernel(req)
    assert result["ok"] is False and "xla_no_such_flag" in result["error"], result
    # the request's flags, not those of the process that asks for the compile
    monkeypatch.setenv("LIBTPU_INIT_ARGS", "--xla_tpu_shell_only_flag=1")
    result = compile_kernel(req)
    assert "xla_no_such_flag" in result["error"] and "shell_only" not in result["error"], result


# --- mode=compile: the whole training step, traced on XLA:CPU and compiled by libtpu ---------

TINY_TPU = ["model=d2", "model.sequence_len=256", "trainer.device_batch_size=2",
            "trainer.total_batch_size=2048", "data=cpp16k"]


def _xtrain(args, cache, timeout=900):
    env = {**os.environ, "XTRAIN_CACHE": str(cache)}
    return subprocess.run([sys.executable, "-m", "xtrain", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=cache)


def test_collective_summary_counts_ops_and_result_bytes():
    hlo = """
  %all-gather.1 = f32[64,32]{1,0} all-gather(f32[16,32]{1,0} %p), dimensions={0}
  %ags = (bf16[8]{0}, bf16[32]{0}) all-gather-start(bf16[8]{0} %q), dimensions={0}
  %agd = bf16[32]{0} all-gather-done((bf16[8]{0}, bf16[32]{0}) %ags)
  ROOT %all-reduce.2 = f32[10]{0} all-reduce(f32[10]{0} %g), to_apply=%add
  %fusion = f32[4]{0} fusion(f32[4]{0} %all-reduce-like), kind=kLoop
  %all-gather.7 = f32[128,8]{1,0} all-gather(f32[32,8]{1,0} %r), channel_id=26, dimensions={0}
"""
    # the TPU compiler's async collective fusions repeat one gather (same channel) many times
    clones = "\n".join(f"  %all-gather.{9 + i} = f32[128,8]{{1,0}} all-gather(f32[32,8]{{1,0}} %c{i}), "
                       f"channel_id=26, dimensions={{0}}" for i in range(30))
    assert collective_summary(hlo + clones) == {
        "all-gather": {"count": 3, "bytes": 64 * 32 * 4 + 32 * 2 + 128 * 8 * 4},
        "all-reduce": {"count": 1, "bytes": 40}}


def test_trace_gives_every_argument_its_sharding_and_donation(compose_config, tmp_path):
    """The traced fsdp step: parameters and their optimizer buffers sharded like the rules say,
    the batch over the batch axes, every piece of state donated to its own update, and the
    micro-batches fenced one after another."""
    from omegaconf import OmegaConf

    # 4 micro-batches (total 8192 tokens), blocks unrolled without remat: no other barrier
    cfg = compose_config(["hardware=v6e4", *TINY_TPU, "parallelism=fsdp", "mode=compile",
                          "trainer.total_batch_size=8192", "model.scan=false", "model.remat=false"])
    plan = resolve(cfg, 4)
    assert plan.batch.grad_accum_steps == 4
    OmegaConf.save(cfg, tmp_path / "config.yaml", resolve=True)
    r = subprocess.run([sys.executable, "-m", "xtrain.preflight.trace", str(tmp_path / "config.yaml"),
                        str(tmp_path)], capture_output=True, text=True, timeout=300,
                       env=trace_environment(cfg.hardware))
    assert r.returncode == 0, r.stderr[-2000:]
    traced = json.loads((tmp_path / "step.json").read_text())
    text = (tmp_path / "step.mlir").read_text()
    assert traced["devices"] == 4 and "func.func @main" in text
    n_params = 2 + 6 * 2  # wte, lm_head, 6 matrices per block
    n_state = n_params + 6 * 2 + 2 * 2 + 1  # + Muon momentum, AdamW m and v, the step counter
    assert len(traced["results"]) == n_state + 2  # + LR multiplier and loss
    aliases = [a["alias"] for a in traced["args"] if a["alias"] is not None]
    assert sorted(aliases) == list(range(n_state))
    shardings = {a["sharding"] for a in traced["args"]}
    assert "{devices=[4,1,1]0,1,2,3}" in shardings  # tokens [B, A, T+1]: rows over 4 devices
    assert "{devices=[4,1]0,1,2,3}" in shardings  # fsdp: the first dimension of the matrices
    assert plan.mesh == {"data": 1, "fsdp": 4, "tensor": 1}
    # micro-batches ordered: a barrier before each one after the first (xtrain/engines/step.py)
    assert text.count("stablehlo.optimization_barrier") == 3


def test_compile_mode_measures_the_step_caches_it_and_plan_shows_it(tmp_path):
    pytest.importorskip("libtpu", reason="the tpu extra (libtpu 0.0.21) is not installed")
    args = ["hardware=v6e4", *TINY_TPU, "mode=compile"]
    r = _xtrain(args, tmp_path)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    out = r.stdout
    assert "TPU compile (v6e4, libtpu 0.0.21): ok" in out
    hbm = re.search(r"HBM/chip \(compiler\): ([\d.]+) GiB of 32 GiB", out)
    assert hbm and 0.05 < float(hbm.group(1)) < 2, out
    assert re.search(r"FLOPs/step/chip \(compiler\): [1-9]", out)
    assert "all-reduce" in out  # data parallel: the gradients are summed across chips
    cached = list((tmp_path / "preflight").glob("*.json"))
    assert len(cached) == 1
    report = json.loads(cached[0].read_text())
    assert report["step"]["alias_bytes"] > 0  # donated state, as in a real step
    # the compiler's own peak host memory: libtpu alone maps hundreds of MiB
    assert 2**28 < report["step"]["host_peak_bytes"] < os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert re.search(r"ok in [\d.]+ s, [\d.]+ GiB of host RAM", out)

    again = _xtrain(args, tmp_path)
    assert again.returncode == 0 and "cached result" in again.stdout
    assert hbm.group(0) in again.stdout
    plan = _xtrain(["hardware=v6e4", *TINY_TPU, "mode=plan"], tmp_path)
    assert plan.returncode == 0 and hbm.group(0) in plan.stdout and "HBM/chip (planner)" in plan.stdout
    other = _xtrain(["hardware=v6e4", *TINY_TPU, "model.depth=3", "mode=plan"], tmp_path)
    assert "TPU compiler: not run yet" in other.stdout


def test_fsdp_divides_the_resident_state_the_compiler_reports(tmp_path):
    pytest.importorskip("libtpu", reason="the tpu extra (libtpu 0.0.21) is not installed")
    reports = {}
    for parallelism in ("dp", "fsdp"):
        cfg = compose_cfg(["hardware=v6e4", *TINY_TPU, f"parallelism={parallelism}", "mode=compile"])
        reports[parallelism] = run_preflight(cfg, resolve(cfg, 4))["step"]
    dp, fsdp = reports["dp"], reports["fsdp"]
    assert dp["ok"] and fsdp["ok"]
    assert fsdp["argument_bytes"] < 0.4 * dp["argument_bytes"]  # weights and state split 4 ways
    assert "all-gather" in fsdp["collectives"] and "all-gather" not in dp["collectives"]


def test_compile_mode_exits_non_zero_when_the_step_does_not_fit(tmp_path):
    pytest.importorskip("libtpu", reason="the tpu extra (libtpu 0.0.21) is not installed")
    # a chip with 64 MiB of HBM: the real compiled figure must be checked against the profile
    r = _xtrain(["hardware=v6e4", *TINY_TPU, "hardware.hbm_gib_per_chip=0.0625", "mode=compile"],
                tmp_path)
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
    assert "HBM/chip (compiler)" in r.stdout
    assert re.search(r"does not fit: the compiled step needs [\d.]+ GiB per chip, the chip has 0 GiB",
                     r.stderr)


def test_compile_mode_reports_the_compilers_out_of_memory_with_its_numbers(tmp_path):
    pytest.importorskip("libtpu", reason="the tpu extra (libtpu 0.0.21) is not installed")
    # 512 rows of 256 tokens per chip: the bf16 logits alone (512 x 256 x 65536) need 16 GiB, a
    # v5e chip's whole HBM (v5e rather than v6e's 32 GiB: the compiler gives up in half the time)
    r = _xtrain(["hardware=v5e8", *TINY_TPU, "trainer.device_batch_size=512",
                 "trainer.total_batch_size=1048576", "mode=compile"], tmp_path)
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
    assert "TPU compile (v5e8): out of HBM" in r.stdout
    # the compiler's own report, naming the logits buffer
    assert "Ran out of memory in memory space hbm" in r.stdout and "bf16[512,256,65536]" in r.stdout
    used = re.search(r"HBM/chip \(compiler\): at least ([\d.]+) GiB of ([\d.]+) GiB usable", r.stdout)
    assert used and float(used.group(1)) > float(used.group(2)) > 15
    assert "does not fit: the TPU compiler needs at least" in r.stderr


def test_flash_attention_kernel_is_compiled_inside_the_step(tmp_path):
    pytest.importorskip("libtpu", reason="the tpu extra (libtpu 0.0.21) is not installed")
    cfg = compose_cfg(["hardware=v6e4", *TINY_TPU, "model.attention=flash", "mode=compile"])
    report = run_preflight(cfg, resolve(cfg, 4))
    assert report["step"]["ok"], report["step"]
    assert [(k["kernel"], k["ok"]) for k in report["kernels"]] == [("flash", True)]


def test_windowed_layers_trace_with_splash_inside_the_step(tmp_path):
    """A sliding-window layer runs torch_xla's splash kernel (a shard_map through call_jax): it
    is traced with the kernel lowered for the TPU and compiled with the rest of the step."""
    pytest.importorskip("libtpu", reason="the tpu extra (libtpu 0.0.21) is not installed")
    pytest.importorskip("torchax", reason="torch_xla's torchax does not import: flax missing (pip install 'xtrain[tpu]')")
    cfg = compose_cfg(["hardware=v6e4", *TINY_TPU, "model.attention=flash",
                       "model.window_pattern=SL", "model.head_dim=128", "mode=compile"])
    plan = resolve(cfg, 4)
    assert plan.gpt.windows == (128, None)
    report = run_preflight(cfg, plan)
    assert report["step"]["ok"], report["step"]
    assert report["step"]["temp_bytes"] > 0
    assert [(k["kernel"], k["window"], k["ok"]) for k in report["kernels"]] == [
        ("flash", None, True), ("splash", 128, True)]


def test_compile_mode_refuses_a_profile_without_a_tpu(compose_config):
    from xtrain.errors import ConfigError
    from xtrain.modes import run

    with pytest.raises(ConfigError, match="hardware=cpu is not a TPU profile"):
        run(compose_config(["mode=compile"]), "unused")


MOSAIC = Path(__file__).resolve().parent / "fixtures" / "mosaic"
RECORD_MOSAIC = """Re-record (a second environment with jax 0.7.1, no libtpu needed):
  python3.11 -m venv /tmp/jax071 && /tmp/jax071/bin/pip install jax==0.7.1 jaxlib==0.7.1
  python -m tests.test_tpu_compile /tmp/jax071/bin/python"""


def test_an_incompatible_jax_libtpu_pair_is_reported_with_the_compilers_reason():
    """jax 0.7.1 writes Mosaic IR v8, libtpu 0.0.21 reads <= 7: a broken pin, caught with no TPU
    and no second environment. tests/fixtures/mosaic/flash_jax071.mlir is the flash kernel
    (forward and backward) as jax 0.7.1 lowered it for the TPU (see RECORD_MOSAIC); the pinned
    libtpu compiles it exactly as a kernel the pinned jax lowers in the same child."""
    pytest.importorskip("libtpu", reason="the tpu extra (libtpu 0.0.21) is not installed")
    recorded = json.loads((MOSAIC / "flash_jax071.json").read_text())
    assert recorded["lowered_by"] == {"jax": "0.7.1", "jaxlib": "0.7.1"}
    request = recorded["request"]
    mismatched = compile_kernel({**request, "lowered": str(MOSAIC / "flash_jax071.mlir")})
    assert mismatched["ok"] is False
    assert "Failed to deserialize the Mosaic module" in mismatched["error"], mismatched
    assert "Unsupported version: expected <= 7 but got 8" in mismatched["error"], mismatched
    pinned = compile_kernel(request)  # the same request, lowered by the pinned jax
    assert pinned["ok"] and pinned["jax"] == "0.7.0", pinned


def record_mosaic_fixture(python: str) -> None:
    """Lower the fixture's request with ``python`` (an environment with jax 0.7.1)."""
    from xtrain.preflight.runner import lower_kernel

    request = {"topology": {"platform": "tpu", "topology_name": "v6e:2x2"}, "kernel": "flash",
               "window": None, "shape": [1, 8, 512, 128]}
    result = lower_kernel(request, str(MOSAIC / "flash_jax071.mlir"), python=python)
    assert result["ok"], result
    lowered_by = {"jax": result["jax"], "jaxlib": result["jaxlib"]}
    (MOSAIC / "flash_jax071.json").write_text(
        json.dumps({"request": request, "lowered_by": lowered_by, "how": RECORD_MOSAIC}, indent=2) + "\n")


def test_the_compilers_out_of_memory_numbers_are_read():
    error = ("XlaRuntimeError: RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of "
             "memory in memory space hbm. Used 33.98G of 31.25G hbm. Exceeded hbm capacity by 2.73G.")
    used, usable = hbm_from_error(error)
    assert used == int(33.98 * 2**30) and usable == int(31.25 * 2**30)
    single = ("RESOURCE_EXHAUSTED: Allocation (size=34359738368) would exceed memory "
              "(size=33822867456) :: #allocation448 [shape = 'bf16[1024,256,65536]']")
    assert hbm_from_error(single) == (34359738368, 33822867456)
    assert hbm_from_error("INVALID_ARGUMENT: something else") is None


def _report(step_ok=True, step_answered=True, kernel_answered=True) -> dict:
    """A preflight report as run_preflight makes it (figures made up), a step that fits."""
    gib = 2**30
    step = {"ok": step_ok, "answered": step_answered, "seconds": 9.0, "host_peak_bytes": 3 * gib,
            "argument_bytes": gib, "temp_bytes": 2 * gib, "output_bytes": gib, "alias_bytes": gib,
            "flops": 1e12, "collectives": {},
            "error": "" if step_ok else "the compiler process was killed (SIGKILL)"}
    kernel = {"kernel": "flash", "shape": [8, 8, 2048, 128], "window": None, "seconds": 600.0,
              "ok": kernel_answered, "answered": kernel_answered,
              "error": "" if kernel_answered else "the TPU compiler took longer than 600 s"}
    return {"hardware": "v6e4", "hbm_bytes_per_chip": 32 * gib, "planner_bytes": 3 * gib,
            "versions": {"libtpu": "0.0.21"}, "hlo_ops": 100, "step": step, "kernels": [kernel]}


@pytest.mark.parametrize("case", ["step killed", "kernel timed out"])
def test_a_compile_that_did_not_finish_gives_no_verdict_on_the_config(case):
    """A compile killed (the OOM killer) or past its time limit: not the compiler's answer, so
    neither the step nor the kernel "does not compile"; the report says so, whichever it was."""
    from xtrain.preflight.report import describe, verdict

    report = _report(step_ok=case != "step killed", step_answered=case != "step killed",
                     kernel_answered=case != "kernel timed out")
    assert verdict(report).startswith("no verdict: a TPU compile did not finish (killed"), verdict(report)
    assert describe(report).endswith("this result is not cached, the next run compiles again)")
    assert verdict(_report()) is None and "not cached" not in describe(_report())
    # the step's own answer stands, whatever became of a kernel's compile
    too_big = _report(kernel_answered=False)
    too_big["step"].update(ok=False, error="RESOURCE_EXHAUSTED: Ran out of memory in memory space "
                                           "hbm. Used 40.00G of 31.25G hbm.")
    assert verdict(too_big).startswith("does not fit: the TPU compiler needs at least 40.00 GiB")


def test_a_cached_report_shows_the_planners_figure_of_now(compose_config, tmp_path, monkeypatch):
    """The cache key leaves the planner out (its estimate changes no compile): a report stored
    before the planner changed shows the planner's figure of now, not the stored one."""
    from xtrain.preflight.cache import cached_report, store_report

    monkeypatch.setenv("XTRAIN_CACHE", str(tmp_path))
    cfg = compose_config(["hardware=v6e4", *TINY_TPU, "mode=compile"])
    plan = resolve(cfg, 4)
    store_report(cfg, plan, {**_report(), "planner_bytes": 12345})
    assert cached_report(cfg, plan)["planner_bytes"] == int(plan.memory.total) != 12345


def test_cache_key_follows_step_shaping_code_only(compose_config, tmp_path):
    """Editing metrics or evaluation code keeps a cached compile; editing the model, the step,
    the optimizer or an engine invalidates it."""
    import shutil

    from xtrain.preflight.cache import PACKAGE, cache_key

    cfg = compose_config(["hardware=v6e4", *TINY_TPU, "mode=compile"])
    plan = resolve(cfg, 4)
    copy = tmp_path / "xtrain"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    before = cache_key(cfg, plan, copy)
    assert before == cache_key(cfg, plan, PACKAGE)  # the copy is the same code
    for unrelated in ("observe/metrics.py", "train/run.py", "cli.py"):
        (copy / unrelated).write_text((copy / unrelated).read_text() + "\n# edited\n")
    assert cache_key(cfg, plan, copy) == before
    # (the preflight's own: what it asks the compiler for, and how it reads the answers it stores)
    for shaping in ("model/gpt.py", "engines/step.py", "optim.py", "xla/spmd.py",
                    "preflight/targets.py", "preflight/runner.py", "preflight/report.py"):
        edited = copy / shaping
        original = edited.read_text()
        edited.write_text(original + "\n# edited\n")
        assert cache_key(cfg, plan, copy) != before, shaping
        edited.write_text(original)
    assert cache_key(cfg, plan, copy) == before


def test_cache_key_follows_the_compilers_flags(compose_config, monkeypatch):
    """The flags the compile used, wherever they were set (the profile's or the environment's)."""
    from xtrain.preflight.cache import cache_key

    monkeypatch.delenv("LIBTPU_INIT_ARGS", raising=False)
    cfg = compose_config(["hardware=v6e4", *TINY_TPU, "mode=compile"])
    plan = resolve(cfg, 4)
    profiles = cache_key(cfg, plan)
    monkeypatch.setenv("LIBTPU_INIT_ARGS", cfg.hardware.env.LIBTPU_INIT_ARGS)
    assert cache_key(cfg, plan) == profiles  # the same flags from the environment
    monkeypatch.setenv("LIBTPU_INIT_ARGS", "--xla_jf_hlo_deduplication=true")
    assert cache_key(cfg, plan) != profiles
    monkeypatch.setenv("LIBTPU_INIT_ARGS", "")
    assert cache_key(cfg, plan) != profiles  # no flags at all


if __name__ == "__main__":
    record_mosaic_fixture(sys.argv[1])
