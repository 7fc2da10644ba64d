"""Compiling fast and once: torch.compile on the CPU engine (same losses, no recompilation, exact
resume), the fused head + softcap + cross-entropy loss, the XLA persistent compile cache (local and
through a GCS emulator), and the TPU preflight's handling of killed compiles and host memory."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import assert_same_tensors, checkpoint_tensors, child_pids, compose_cfg, read_jsonl
from xtrain.errors import EXIT_REFUSED
from test_checkpoint import finish, losses, preempt_and_resume, xtrain

ROOT = Path(__file__).resolve().parent.parent


# --- torch.compile on the CPU engine --------------------------------------------------------


def _records(run_dir):
    return [r for r in read_jsonl(Path(run_dir) / "metrics.jsonl") if "loss" in r]


@pytest.mark.slow  # over a minute on 2 cores: several cold inductor compiles
def test_compile_gives_the_eager_losses_and_never_recompiles(tmp_path):
    """20 steps with validation every 10 and a checkpoint every 7: the losses of compile on and
    off agree to 1e-4, and after the first step no graph is ever compiled again."""
    extra = ["trainer.max_steps=20", "trainer.eval_every=10", "checkpoint.every=7"]
    runs = {}
    for flag in ("false", "true"):
        code, out, err = finish(xtrain(tmp_path / flag, *extra, f"trainer.compile={flag}"), 900)
        assert code == 0, err[-3000:]
        runs[flag] = (_records(tmp_path / flag), out)
    eager, compiled = runs["false"][0], runs["true"][0]
    assert [r["step"] for r in compiled] == list(range(1, 21))
    worst = max(abs(a["loss"] - b["loss"]) / b["loss"] for a, b in zip(compiled, eager))
    assert worst <= 1e-4, worst
    counts = [r["torch_compiles"] for r in compiled]
    # the training forward (+ its AOTAutograd backward) and the optimizer update before step 1's
    # log; then nothing: validation runs the eager forward, checkpoints compile nothing
    assert counts == [2] * 20, counts
    assert "torch_compiles" not in eager[0]
    out = runs["true"][1]
    assert re.search(r"torch\.compile: first step [\d.]+ s \(compiling included; \d+ of \d+ graphs from the "
                     r"cache\)", out)
    assert "val loss" in out


@pytest.mark.slow  # over a minute on 2 cores: several cold inductor compiles
def test_sigterm_resume_with_compile_is_bitwise(tmp_path):
    """As on the eager CPU engine: the resumed run's losses and its final parameters and
    optimizer state equal the uninterrupted run's, bit for bit. (Before torch's deterministic
    mode, xtrain/engines/torch_compile.py, two identical compiled runs already differed from
    the 5th step on: the compiled embedding backward added repeated ids in a varying order.)"""
    straight, resumed, _ = preempt_and_resume(tmp_path, extra=["trainer.compile=true"])
    assert sorted(resumed) == list(range(1, 41))
    assert all(resumed[s] == straight[s] for s in range(1, 41))  # unrounded float32 losses
    final = checkpoint_tensors(tmp_path / "straight" / "checkpoints" / "step_000040")
    assert_same_tensors(final, checkpoint_tensors(tmp_path / "preempted" / "checkpoints" / "step_000040"))


@pytest.mark.slow  # over a minute on 2 cores: several cold inductor compiles
def test_compiled_code_is_cached_under_the_xtrain_cache(tmp_path):
    cache = tmp_path / "cache"
    env = {"XTRAIN_CACHE": str(cache)}
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)
    first = finish(xtrain(tmp_path / "a", "trainer.max_steps=3", "trainer.compile=true", env=env), 900)
    assert first[0] == 0, first[2][-3000:]
    assert any((cache / "inductor").rglob("*.py"))  # inductor's generated kernels
    second = finish(xtrain(tmp_path / "b", "trainer.max_steps=3", "trainer.compile=true", env=env), 900)
    assert second[0] == 0, second[2][-3000:]
    found = [re.search(r"first step [\d.]+ s \(compiling included; (\d+) of (\d+) graphs from the cache\)",
                       out).groups() for _, out, _ in (first, second)]
    hits, lookups = zip(*[(int(h), int(n)) for h, n in found])
    assert hits[0] == 0 and lookups[0] > 0  # an empty cache: every graph compiled
    assert hits[1] == lookups[1] == lookups[0]  # the relaunch loads every graph the first compiled


def test_compile_defaults_to_on_where_it_pays(compose_config):
    from xtrain.engines.torch_compile import compile_pays
    from xtrain.plan import resolve

    assert not compile_pays(resolve(compose_config([]), 1))  # make train: d4 at 256 tokens
    assert compile_pays(resolve(compose_config(["model.sequence_len=512"]), 1))


# --- the C allocator keeps freed memory ------------------------------------------------------

FAULTS_DRIVER = r"""
import resource, sys, torch
from xtrain.engines.cpu import keep_freed_memory
if sys.argv[1] == "keep":
    assert keep_freed_memory()
faults = []
for _ in range(4):  # a step's 64 MiB temporary, allocated, written and freed four times
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    x = torch.empty(16 << 20)
    x.fill_(1.0)
    del x
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(faults[-1])
"""


@pytest.mark.parametrize("keep", [False, True])
def test_freed_step_memory_is_reused_without_page_faults(keep):
    """glibc's default unmaps a freed 64 MiB block and faults all 16,384 of its pages in again
    at the next allocation; with the CPU engine's allocator settings the block is reused."""
    r = subprocess.run([sys.executable, "-c", FAULTS_DRIVER, "keep" if keep else "default"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    pages = (64 << 20) // os.sysconf("SC_PAGE_SIZE")
    last_faults = int(r.stdout.split()[-1])
    if keep:
        assert last_faults < pages // 100
    else:
        assert last_faults >= pages * 9 // 10


# --- the fused head + softcap + cross-entropy ------------------------------------------------


def _head_loss_case(cap: float):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(4, 300, 64, generator=g)
    w = torch.randn(1024, 64, generator=g) * 2  # logits up to ~60: the cap bites
    if cap > 40:  # every logit below -100: exp(capped - cap) underflows to 0 without the row maximum
        h, w = h.abs() + 1, -w.abs() - 1
    h, w = h.requires_grad_(), w.requires_grad_()
    y = torch.randint(0, 1024, (4, 300), generator=g)
    y[0, :7] = -1  # PAD targets are not scored
    from xtrain.model.loss import softcap

    reference = torch.nn.functional.cross_entropy(softcap(h @ w.t(), cap).reshape(-1, 1024),
                                                  y.reshape(-1), ignore_index=-1)
    return h, w, y, reference, torch.autograd.grad(reference, (h, w))


@pytest.mark.parametrize("cap", [15.0, 60.0])  # log-sum-exp shifted by the cap; by the row maximum
def test_fused_head_loss_equals_the_unfused_ops_and_saves_no_logits(cap, monkeypatch):
    from xtrain.model import loss

    monkeypatch.setattr(loss, "SLICE_ELEMENTS", 1 << 18)  # several slices of this small case
    h, w, y, reference, ref_grads = _head_loss_case(cap)
    saved = []

    def pack(t):
        saved.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fused = loss.softcap_cross_entropy(h, w, y, cap)
    grads = torch.autograd.grad(fused, (h, w))
    assert len(loss._row_slices(4 * 300, 1024)) > 1  # the case runs in several slices
    assert abs(fused.item() - reference.item()) <= 1e-6 * reference.item()
    for grad, ref in zip(grads, ref_grads):
        assert (grad - ref).abs().max() <= 1e-4 * ref.abs().max(), (grad - ref).abs().max()
    # saved for backward: the gradients of the hidden states and of the head, and the count;
    # no logits-sized buffer (4 x 300 x 1024 floats)
    assert sum(saved) <= (h.numel() + w.numel() + 1) * 4


# --- the XLA persistent compile cache --------------------------------------------------------

CACHE_DRIVER = r"""
import json, sys
from tests.conftest import compose_cfg
from xtrain.modes import run
import torch_xla.debug.metrics as met
cfg = compose_cfg(json.loads(sys.argv[1]), output_dir=sys.argv[2])
run(cfg, sys.argv[2])
print("METRICS " + json.dumps({k: (met.counter_value(k) or 0) for k in
      ("PersistentCacheHit", "PersistentCacheMiss", "PersistentCacheLoad", "PersistentCacheDeserializeFailure")}))
"""


def _xla_run(tmp_path, name, overrides, env=None):
    env = {**os.environ, "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "4", **(env or {})}
    r = subprocess.run([sys.executable, "-c", CACHE_DRIVER, json.dumps(overrides), str(tmp_path / name)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    line = [ln for ln in r.stdout.splitlines() if ln.startswith("METRICS ")][-1]
    return json.loads(line[len("METRICS "):]), r.stdout


XLA_RUN = ["model=d2", "model.sequence_len=64", "trainer.max_steps=3", "trainer.sample_tokens=0",
           "trainer.eval_tokens=128", "hardware.engine=xla", "parallelism=fsdp",
           "trainer.device_batch_size=2", "compile_cache.enabled=true"]


def _served(metrics) -> int:
    """Graphs whose compiled entry the persistent cache found. torch_xla 2.9.0 then fails to load
    it on every backend (DeserializeFailure; pytorch/xla#9094, xtrain/xla/compile_cache.py) and
    compiles again; a torch_xla that loads it counts a Hit. Either way nothing missed."""
    return metrics["PersistentCacheHit"] + metrics["PersistentCacheDeserializeFailure"]


def _entries(path):
    return sorted(p.name for p in Path(path).rglob("*") if p.is_file())


def test_a_relaunch_finds_its_compiled_step_and_a_new_shape_misses(tmp_path):
    pytest.importorskip("torch_xla")
    cache = [f"compile_cache.dir={tmp_path / 'xla_cache'}"]
    first, _ = _xla_run(tmp_path, "first", [*XLA_RUN, *cache])
    # optimizer-state init, training step, validation step: each compiled and stored
    assert first["PersistentCacheMiss"] == 3 and _served(first) == 0
    stored = _entries(tmp_path / "xla_cache")
    assert len(stored) == 3
    again, out = _xla_run(tmp_path, "again", [*XLA_RUN, *cache])
    assert again["PersistentCacheMiss"] == 0 and _served(again) == 3
    assert _entries(tmp_path / "xla_cache") == stored  # nothing new to store
    assert "XLA compile cache: " in out and "3 entries" in out
    assert re.search(r"XLA compile cache \(end of training\): \d+ graphs loaded, 0 compiled", out)
    other, _ = _xla_run(tmp_path, "other", [*XLA_RUN, *cache, "model.depth=3"])
    assert other["PersistentCacheMiss"] >= 2 and _served(other) <= 1  # the state init may match
    assert len(_entries(tmp_path / "xla_cache")) == 3 + other["PersistentCacheMiss"]


def test_a_fresh_machine_finds_the_compiled_step_in_the_bucket(tmp_path, gcs_bucket):
    pytest.importorskip("torch_xla")
    bucket, server = gcs_bucket
    env = {"STORAGE_EMULATOR_HOST": server.url, "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"}
    # each machine has its own (empty) cache; the corpus is the session's, built once, not
    # again per machine: what is on trial is only the compile cache
    corpus = f"data.build_dir={compose_cfg(XLA_RUN).data.build_dir}"
    remote = [f"compile_cache.dir={bucket}/xla_cache", corpus]
    first, out = _xla_run(tmp_path, "first", [*XLA_RUN, *remote],
                          {**env, "XTRAIN_CACHE": str(tmp_path / "vm1")})
    pushed = [int(n) for n in re.findall(r"(\d+) new entries pushed to gs://xtrain-test/xla_cache", out)]
    assert first["PersistentCacheMiss"] == 3 and sum(pushed) == 3  # after step 1, then at the end
    assert not (tmp_path / "vm2").exists()
    fresh, out = _xla_run(tmp_path, "fresh", [*XLA_RUN, *remote],
                          {**env, "XTRAIN_CACHE": str(tmp_path / "vm2")})  # an empty local cache
    assert re.search(r"mirror gs://xtrain-test/xla_cache/\w+: 3 entries pulled\), 3 entries", out)
    assert fresh["PersistentCacheMiss"] == 0 and _served(fresh) == 3
    assert re.findall(r"(\d+) new entries pushed", out) == ["0", "0"]


PUSH_TO_A_GONE_BUCKET = r"""
import sys
from xtrain.xla.compile_cache import CompileCache
from xtrain.xla.lightning import CompileCacheSync
cache = CompileCache(sys.argv[1], "key")
(cache.local / "entry").write_bytes(b"compiled")
CompileCacheSync(cache, rank=0).on_exception()
print("SURVIVED")
"""


def test_a_mirror_that_cannot_be_written_is_refused_first_and_a_failed_push_warns(tmp_path, gcs_bucket):
    """The compile cache only saves time: a mirror in no bucket is refused before any work (it
    once crashed the run at its first push, after the step's compile); a push that fails later
    (here the bucket is gone), or a pull, costs a warning, not the run."""
    pytest.importorskip("torch_xla")
    env = {**os.environ, "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "4", "XTRAIN_CACHE": str(tmp_path / "c")}
    r = subprocess.run([sys.executable, "-m", "xtrain", *XLA_RUN, "compile_cache.dir=gs://no-such-bucket/xla"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == EXIT_REFUSED, r.stderr[-2000:]
    assert "compile_cache.dir gs://no-such-bucket/xla is not writable (" in r.stderr
    assert not list(Path(tmp_path / "c").rglob("xla_compile_mirror/*"))  # nothing compiled
    r = subprocess.run([sys.executable, "-c", PUSH_TO_A_GONE_BUCKET, "gs://no-such-bucket/xla"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "SURVIVED" in r.stdout, r.stderr[-2000:]
    assert "xtrain: warning: compile cache entries not pushed to gs://no-such-bucket/xla/key (" in r.stderr


def test_the_cache_key_follows_the_compiler_stack_and_the_codegen_environment(compose_config):
    from xtrain.xla.compile_cache import cache_key

    hw = compose_config(["hardware=v6e4"]).hardware
    base = cache_key(hw, {"PJRT_DEVICE": "TPU"})
    assert cache_key(hw, {"PJRT_DEVICE": "TPU", "XTRAIN_CACHE": "/elsewhere"}) == base
    assert cache_key(hw, {"PJRT_DEVICE": "TPU", "LIBTPU_INIT_ARGS": "--xla_tpu_x=1"}) != base
    assert cache_key(compose_config(["hardware=v6e8"]).hardware, {"PJRT_DEVICE": "TPU"}) != base


# --- the TPU preflight: killed compiles, program size, host memory --------------------------

TINY_TPU = ["hardware=v6e4", "model=d2", "model.sequence_len=256", "trainer.device_batch_size=2",
            "trainer.total_batch_size=2048", "data=cpp16k", "mode=compile"]


def _compile_mode(cache, *extra):
    return subprocess.Popen([sys.executable, "-m", "xtrain", *TINY_TPU, *extra], cwd=cache,
                            env={**os.environ, "XTRAIN_CACHE": str(cache)}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _wait_for_compiler(pid: int, timeout=600) -> int:
    """The pid of the step's TPU compiler child of ``pid`` (xtrain.preflight.tpu_compile step)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        for child in child_pids(pid):
            try:
                cmd = Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")
            except FileNotFoundError:
                continue
            if b"xtrain.preflight.tpu_compile" in cmd and b"step" in cmd:
                return child
        time.sleep(0.05)
    raise TimeoutError("the TPU compiler child never started")


def test_a_killed_compile_is_not_cached_and_the_next_run_compiles(tmp_path):
    pytest.importorskip("libtpu", reason="the tpu extra (libtpu 0.0.21) is not installed")
    proc = _compile_mode(tmp_path)
    os.kill(_wait_for_compiler(proc.pid), signal.SIGKILL)  # as the OOM killer does
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 2, err[-2000:]
    assert "the compiler process was killed (SIGKILL)" in out and "not cached" in out
    assert "no verdict: a TPU compile did not finish" in err and "does not compile" not in err
    assert not list((tmp_path / "preflight").glob("*.json"))
    again = _compile_mode(tmp_path)
    out, err = again.communicate(timeout=900)
    assert again.returncode == 0, out[-2000:] + err[-2000:]
    assert "cached result" not in out and "TPU compile (v6e4, libtpu 0.0.21): ok" in out
    ops = re.search(r"program: ([\d,]+) StableHLO ops traced, ([\d,]+) HLO instructions compiled", out)
    assert ops and int(ops.group(1).replace(",", "")) > 100 and int(ops.group(2).replace(",", "")) > 100
    (report,) = [json.loads(p.read_text()) for p in (tmp_path / "preflight").glob("*.json")]
    assert report["hlo_ops"] == int(ops.group(1).replace(",", "")) and report["step"]["answered"]


def test_a_compile_expected_to_exceed_host_memory_is_refused_before_it_starts(tmp_path):
    pytest.importorskip("libtpu", reason="the tpu extra (libtpu 0.0.21) is not installed")
    first = _compile_mode(tmp_path)
    out, err = first.communicate(timeout=900)
    assert first.returncode == 0, out[-2000:] + err[-2000:]
    assert re.search(r"host RAM: [\d,]+ StableHLO ops, expected ~[\d.]+ GiB for the compiler \(at "
                     r"the rate of the stated \d+ KiB per op\)", out)  # no earlier compile yet
    # that compile's report, as if it had needed 1 TiB (a rate no machine here can meet), is the
    # earlier compile of a similar program: the same step with another learning rate (the same
    # graph under another cache key)
    (path,) = (tmp_path / "preflight").glob("*.json")
    report = json.loads(path.read_text())
    report["config"], report["step"]["host_peak_bytes"] = "a huge step", 2**40
    path.write_text(json.dumps(report))
    proc = _compile_mode(tmp_path, "optim.matrix_lr=0.03")
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 2
    assert re.search(r"refusing to start the TPU compile: [\d,]+ StableHLO ops are expected to need "
                     r"[\d.]+ GiB of host RAM .* the compile of a huge step .* GiB available", err)
    assert "add swap or use a machine with more RAM" in err and "model.scan=true" in err
    assert "TPU compile" not in out  # the compiler never started


def test_host_memory_rates_come_from_compiles_with_the_same_libtpu_and_flags(tmp_path):
    from xtrain.preflight.hostmem import earlier_compiles

    def report(name, libtpu, flags, ok=True):
        step = {"ok": ok, "host_peak_bytes": 2**32}
        (tmp_path / f"{name}.json").write_text(json.dumps(
            {"config": name, "hlo_ops": 1000, "versions": {"libtpu": libtpu},
             "libtpu_init_args": flags, "step": step}))

    report("same", "0.0.21", "--a=1")
    report("other flags", "0.0.21", "--a=2")
    report("no flags", "0.0.21", None)
    report("other libtpu", "0.0.30", "--a=1")
    report("failed", "0.0.21", "--a=1", ok=False)
    (tmp_path / "torn.json").write_text("{")
    assert [r["what"] for r in earlier_compiles(tmp_path, "0.0.21", "--a=1")] == ["same"]
    assert [r["what"] for r in earlier_compiles(tmp_path, "0.0.21", None)] == ["no flags"]


def test_host_memory_estimate_uses_the_nearest_similar_earlier_compile():
    from xtrain.preflight.hostmem import BASE_BYTES, STATED_BYTES_PER_OP, expected_bytes, refusal
    from xtrain.units import GIB

    earlier = [{"ops": 5_000, "peak": 4 * GIB, "what": "small"},
               {"ops": 200_000, "peak": 21 * GIB, "what": "unrolled d16"}]
    need, source = expected_bytes(150_000, earlier)
    assert need == int(BASE_BYTES + (21 * GIB - BASE_BYTES) / 200_000 * 150_000) and "unrolled d16" in source
    need, source = expected_bytes(4_000, earlier)
    assert need == int(BASE_BYTES + (4 * GIB - BASE_BYTES) / 5_000 * 4_000) and "small" in source
    # more than a factor of 2 from every earlier compile: the stated rate, not the nearest's
    for ops in (40_000, 10, 500_000):
        need, source = expected_bytes(ops, earlier)
        assert need == BASE_BYTES + ops * STATED_BYTES_PER_OP and "stated" in source
    info = {"MemTotal": 24 * GIB, "MemAvailable": 20 * GIB, "SwapFree": 2 * GIB}
    assert refusal(1, 21 * GIB, "x", info, scanned=False) is None
    message = refusal(1, 23 * GIB, "x", info, scanned=False)
    assert "23.0 GiB of host RAM" in message and "22.0 GiB available (RAM 20.0 + free swap 2.0)" in message
    assert "preflight.check_host_ram=false" in message and "model.scan=true" in message
    # a scanned step is offered no model setting
    assert "model.scan" not in refusal(1, 23 * GIB, "x", info, scanned=True)
