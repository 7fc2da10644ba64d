"""The XLA SPMD engine on CPU PJRT with virtual devices (PJRT_DEVICE=CPU CPU_NUM_DEVICES=N).

Each case runs in a child process: the device count is fixed when torch_xla's runtime starts.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import checkpoint_tensors, relative_differences

pytest.importorskip("torch_xla")
ROOT = Path(__file__).resolve().parent.parent
SEQ, ROWS, STEPS = 64, 8, 30  # every run sees the same 8 rows of 64 tokens per step

DRIVER = r"""
import json, sys
from tests.conftest import compose_cfg
from xtrain.modes import run
from xtrain.xla.spmd import counters
from tests.conftest import read_jsonl
out = {}
for job in json.loads(sys.argv[1]):
    cfg = compose_cfg(job["overrides"], output_dir=job["dir"])
    summary = run(cfg, job["dir"])
    records = read_jsonl(job["dir"] + "/metrics.jsonl")
    out[job["name"]] = {"summary": summary, "records": records, "at_exit": counters()}
print("RESULT " + json.dumps(out))
"""


def drive(jobs, devices: int | None = None, timeout=900):
    env = {**os.environ, "PJRT_DEVICE": "CPU", "WANDB_MODE": "offline"}
    if devices:
        env["CPU_NUM_DEVICES"] = str(devices)
    r = subprocess.run([sys.executable, "-c", DRIVER, json.dumps(jobs)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stderr[-4000:]
    line = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


def common(steps=STEPS):
    return ["model=d2", f"model.sequence_len={SEQ}", f"trainer.max_steps={steps}", "trainer.log_every=1",
            "trainer.sample_tokens=0", "trainer.eval_tokens=512", "optim.warmup_steps=3"]


def batch_parallel(parallelism, n):
    return {"dp": n, "fsdp": n, "fsdp_tp": n // 2}[parallelism]  # fsdp_tp: tensor=2


@pytest.fixture(scope="module")
def cpu_reference(tmp_path_factory):
    d = tmp_path_factory.mktemp("cpu")
    res = drive([{"name": "cpu", "dir": str(d), "overrides": common() + [f"trainer.device_batch_size={ROWS}"]}])
    return [r["loss"] for r in res["cpu"]["records"] if "loss" in r]


# Worked out by hand from conf/parallelism/*.yaml (not through xtrain.parallelism): the mesh
# (data, fsdp, tensor) of each parallelism on 4 and 8 devices, and the mesh axis each dim of a
# d2 weight is split over (None: whole). The mesh numbers devices row-major over
# data x fsdp x tensor: device = (data * fsdp_size + fsdp) * tensor_size + tensor.
MESHES = {("dp", 4): (4, 1, 1), ("fsdp", 4): (1, 4, 1), ("fsdp_tp", 4): (1, 2, 2),
          ("dp", 8): (8, 1, 1), ("fsdp", 8): (1, 8, 1), ("fsdp_tp", 8): (2, 2, 2)}
D2_WEIGHTS = ["wte.weight", "lm_head.weight"] + [
    f"blocks.{i}.{w}.weight" for i in range(2)
    for w in ("attn.c_q", "attn.c_k", "attn.c_v", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")]
# Device ids per tile (rows: tiles of dim 0, columns: tiles of dim 1; innermost, sorted: the
# replicas over the data axis), spelled out for a few weights.
TILINGS = {
    ("fsdp", 4): {"blocks.0.mlp.c_fc.weight": [[0], [1], [2], [3]],
                  "wte.weight": [[0], [1], [2], [3]]},
    ("fsdp_tp", 4): {"blocks.0.attn.c_q.weight": [[0, 2], [1, 3]],  # rows over tensor
                     "blocks.1.attn.c_proj.weight": [[0, 1], [2, 3]],  # rows over fsdp
                     "blocks.0.mlp.c_fc.weight": [[0, 2], [1, 3]],
                     "blocks.1.mlp.c_proj.weight": [[0, 1], [2, 3]],
                     "wte.weight": [[0, 2], [1, 3]]},  # vocabulary over tensor
    ("fsdp", 8): {"blocks.1.attn.c_k.weight": [[i] for i in range(8)]},
    ("fsdp_tp", 8): {"blocks.0.attn.c_v.weight": [[[0, 4], [2, 6]], [[1, 5], [3, 7]]],
                     "blocks.0.mlp.c_proj.weight": [[[0, 4], [1, 5]], [[2, 6], [3, 7]]],
                     "lm_head.weight": [[[0, 4], [2, 6]], [[1, 5], [3, 7]]]},
}


def declared_split(parallelism, name):
    if parallelism == "dp":
        return None
    if parallelism == "fsdp":
        return ("fsdp", None)  # every weight's first dim
    if name.endswith("c_proj.weight"):  # row-parallel: input dim over tensor
        return ("fsdp", "tensor")
    return ("tensor", "fsdp")  # q/k/v, fc (column-parallel), wte, lm_head (vocabulary-parallel)


def tile_assignment(hlo):
    """(device ids laid out per tile, whether the last dim is replication) of an HLO tiled
    sharding string, in its explicit form (``devices=[2,2]0,2,1,3``) or its iota form
    (``devices=[2,2]<=[2,2]T(1,0)``)."""
    m = re.fullmatch(r"\{devices=\[([\d,]+)\](\S+)( last_tile_dim_replicate)?\}", hlo)
    assert m, hlo
    dims = [int(x) for x in m[1].split(",")]
    iota = re.fullmatch(r"<=\[([\d,]+)\](?:T\(([\d,]+)\))?", m[2])
    if iota:
        ids = np.arange(math.prod(dims)).reshape([int(x) for x in iota[1].split(",")])
        if iota[2]:
            ids = ids.transpose([int(x) for x in iota[2].split(",")])
        ids = ids.reshape(dims)
    else:
        ids = np.array([int(x) for x in m[2].split(",")]).reshape(dims)
    return ids, m[3] is not None


def check_split(hlo, split, mesh):
    """``hlo`` splits each dim of a 2-D weight over the mesh axis ``split`` names for it: a
    device's tile index along that dim is its coordinate on that axis; the rest is replication."""
    sizes = dict(zip(("data", "fsdp", "tensor"), mesh))
    if split is None:
        assert hlo == "{replicated}", hlo
        return
    ids, replicated = tile_assignment(hlo)
    tiles = [sizes[a] if a else 1 for a in split]
    assert list(ids.shape[:2]) == tiles, (hlo, split, mesh)
    assert replicated == (ids.ndim == 3) == (math.prod(mesh) > math.prod(tiles)), hlo
    assert sorted(ids.flatten().tolist()) == list(range(math.prod(mesh))), hlo
    for device in range(math.prod(mesh)):
        coords = dict(zip(sizes, (int(c) for c in np.unravel_index(device, mesh))))
        where = [int(i) for i in np.argwhere(ids == device)[0][:2]]
        assert where == [coords[a] if a else 0 for a in split], (hlo, split, device, coords)


# 8 devices (a v6e-8's count) checks the same rules on a bigger mesh: with `slow`, to keep the
# default suite near its time budget
@pytest.mark.parametrize("devices", [4, pytest.param(8, marks=pytest.mark.slow)])
def test_parallelisms_match_the_cpu_engine_and_shard_as_declared(devices, cpu_reference, tmp_path):
    jobs = []
    for par in ("dp", "fsdp", "fsdp_tp"):
        rows = ROWS // batch_parallel(par, devices)
        jobs.append({"name": par, "dir": str(tmp_path / par), "overrides": common() + [
            "hardware.engine=xla", f"parallelism={par}", f"trainer.device_batch_size={rows}"]})
    results = drive(jobs, devices)
    for par, res in results.items():
        losses = [r["loss"] for r in res["records"] if "loss" in r]
        assert len(losses) == STEPS
        # float32 on both engines; XLA reorders reductions (and shards them), so not bitwise
        diffs = [abs(a - b) for a, b in zip(losses, cpu_reference, strict=True)]
        assert max(diffs) < 2e-3, (par, devices, max(diffs))
        assert losses[-1] < losses[0] - 2.0
        shardings = res["summary"]["param_shardings"]
        assert sorted(shardings) == sorted(D2_WEIGHTS), (par, shardings)  # every parameter
        for name, hlo in shardings.items():
            check_split(hlo, declared_split(par, name), MESHES[par, devices])
        for name, expected in TILINGS.get((par, devices), {}).items():
            ids, _ = tile_assignment(shardings[name])
            if ids.ndim == 3:  # replicas over data: their order is not the point
                ids = np.sort(ids, axis=-1)
            assert ids.tolist() == expected, (par, name, shardings[name], expected)
        if par != "dp":  # sharded, not merely declared
            assert sum(hlo != "{replicated}" for hlo in shardings.values()) == len(D2_WEIGHTS)
    # each final checkpoint, saved shard by shard, holds every weight as trained: what dp saved
    # whole. fsdp_tp on 8 devices has two replicas of each shard on this one host: torch_xla
    # 2.9's save planner dropped such tensors from the checkpoint, which still committed.
    final = {par: checkpoint_tensors(tmp_path / par / "checkpoints" / f"step_{STEPS:06d}")
             for par in results}
    for par in ("fsdp", "fsdp_tp"):
        weights = [f"/state_dict/model.{name}" for name in D2_WEIGHTS]
        differences = relative_differences({k: final[par][k] for k in weights},
                                           {k: final["dp"][k] for k in weights})
        # the runs differ by float32 reassociation (the embedding most: 2e-3 on 4 devices); a shard saved
        # in another's place would differ by about 1
        assert max(differences.values()) < 1e-2, (par, devices, differences)


ROUND_TRIP = r"""
import io, json, sys
import numpy as np, torch, torch_xla
import torch_xla.distributed.spmd as xs
import torch_xla.runtime as xr
from torch.distributed.checkpoint import FileSystemReader
from xtrain.checkpoint import io as ckpt_io

xr.use_spmd()
mesh = xs.Mesh(np.arange(8), (2, 2, 2), ("data", "fsdp", "tensor"))  # fsdp_tp's on 8 devices

def sharded(value):
    value = value.to(torch_xla.device())
    xs.mark_sharding(value, mesh, ("tensor", "fsdp"))
    return value

w, r = sharded(torch.arange(64.0).reshape(8, 8)), torch.arange(4.0).to(torch_xla.device())
skeleton = io.BytesIO()
torch.save({"w": ckpt_io.TENSOR_REF + "/w", "r": ckpt_io.TENSOR_REF + "/r"}, skeleton)
ckpt_io.write(sys.argv[1], ckpt_io.snapshot({"/w": w, "/r": r}, sharded=True),
              skeleton.getvalue(), {}, sharded=True)
stored = FileSystemReader(sys.argv[1] + "/tensors").read_metadata().state_dict_metadata
into = sharded(torch.zeros(8, 8))
loaded = ckpt_io.read(sys.argv[1], {"/w": into, "/r": torch.zeros(4).to(torch_xla.device())},
                      sharded=True)
print("RESULT " + json.dumps({"stored": {k: len(m.chunks) for k, m in stored.items()},
                              "w": loaded["w"].cpu().tolist(), "r": loaded["r"].cpu().tolist()}))
"""


def test_a_checkpoint_keeps_shards_that_two_devices_of_one_host_hold(tmp_path):
    """fsdp_tp on one 8-chip host: each shard of a weight is on two devices (the data axis).
    torch_xla 2.9's save planner dropped such a tensor from every host's plan, and the checkpoint
    committed without it (xtrain/compat.py sharded_cpu_state_dict); it is saved once per shard and
    read back into the sharded tensor."""
    r = subprocess.run([sys.executable, "-c", ROUND_TRIP, str(tmp_path / "step_000001")], cwd=ROOT,
                       env={**os.environ, "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "8"},
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads([ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")][-1][7:])
    assert out["stored"] == {"/w": 4, "/r": 1}  # 2 x 2 tiles, each once; /r whole
    assert out["w"] == np.arange(64.0).reshape(8, 8).tolist() and out["r"] == [0.0, 1.0, 2.0, 3.0]


RESUME_TARGETS = r"""
import json, sys
import torch_xla
from tests.conftest import compose_cfg
from xtrain.checkpoint.async_io import FsspecCheckpointIO
from xtrain.modes import run

loaded_into = {}
load = FsspecCheckpointIO.load_checkpoint
def spy(self, path, *args, targets=None, **kwargs):
    for key, t in (targets or {}).items():
        xla = t.device.type == "xla"
        loaded_into[key] = [t.device.type, torch_xla._XLAC._get_xla_sharding_spec(t) if xla else ""]
    return load(self, path, *args, targets=targets, **kwargs)
FsspecCheckpointIO.load_checkpoint = spy
overrides = json.loads(sys.argv[2])
run(compose_cfg(overrides + ["trainer.max_steps=2"], output_dir=sys.argv[1]), sys.argv[1])
run(compose_cfg(overrides + ["trainer.max_steps=3"], output_dir=sys.argv[1]), sys.argv[1])
print("RESULT " + json.dumps(loaded_into))
"""


def test_a_resume_reads_into_the_sharded_model_and_optimizer_state(tmp_path):
    """The checkpoint is read once the model is sharded on the devices and the optimizer exists
    (SPMDStrategy.restore_checkpoint_after_setup), straight into those tensors: on a pod each
    host then reads only its shards. Read before setup, the targets were the model's whole CPU
    copy and no optimizer state, which reached the devices unsharded."""
    overrides = common(2) + ["hardware.engine=xla", "parallelism=fsdp", "trainer.device_batch_size=2"]
    r = subprocess.run([sys.executable, "-c", RESUME_TARGETS, str(tmp_path), json.dumps(overrides)],
                       cwd=ROOT, env={**os.environ, "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "4",
                                      "WANDB_MODE": "offline"},
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    loaded_into = json.loads([ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")][-1][7:])
    for key in [f"/state_dict/model.{name}" for name in D2_WEIGHTS]:
        assert loaded_into.get(key, [None])[0] == "xla", (key, loaded_into.get(key))
        assert loaded_into[key][1].startswith("{devices=[4,1]"), (key, loaded_into[key])
    momentum = [k for k in loaded_into if k.endswith("/momentum_buffer")]
    assert len(momentum) == 12 and all(loaded_into[k][0] == "xla" for k in momentum), loaded_into
    assert all(loaded_into[k][1].startswith("{devices=[4,1]") for k in momentum), loaded_into


def test_a_run_resumed_at_its_last_step_runs_the_final_validation_its_log_lacks(tmp_path):
    """The end of a run stopped between its final checkpoint and its final validation
    (xtrain/train/finish.py: here the log's record taken away, as if that validation never ran):
    run again, the validation outside fit gives the figures it gave inside fit. The last step,
    not a multiple of eval_every, is validated after fit: on the graphs fit compiled, with the
    model still sharded on the devices (no gather to the host when fit ends). Before that, the
    run cut back to step 2, stopped before that step's validation (xtrain/train/catch_up.py),
    validates it before step 3 on the same graphs, with the same figures."""
    job = {"name": "run", "dir": str(tmp_path), "overrides": common(3) + [
        "hardware.engine=xla", "parallelism=fsdp", "trainer.device_batch_size=2", "trainer.eval_every=2",
        "checkpoint.every=2"]}
    result = drive([job], 4)["run"]
    assert [r["step"] for r in result["records"] if r["kind"] == "val"] == [2, 3]
    assert result["at_exit"] == {"xla_compiles": 3, "host_syncs": 3 + 2 + 2 + 2}, result["at_exit"]
    log = tmp_path / "metrics.jsonl"
    figures = [(r["step"], r["val_loss"], r["val_bpb"]) for r in result["records"] if r["kind"] == "val"]
    shutil.rmtree(tmp_path / "checkpoints" / "step_000003")
    log.write_text("".join(json.dumps(r) + "\n" for r in result["records"]
                           if r["step"] < 2 or (r["step"] == 2 and r["kind"] != "val")))
    cut = drive([job], 4)["run"]
    assert [(r["step"], r["val_loss"], r["val_bpb"]) for r in cut["records"] if r["kind"] == "val"] \
        == figures
    # no graph of its own: a resumed run's 3, and the restore's (one small graph of the restored
    # tensors' copies onto the devices)
    assert cut["at_exit"]["xla_compiles"] == 4, cut["at_exit"]
    first = [r for r in result["records"] if r["kind"] == "val" and r["step"] == 3]
    log.write_text("".join(line for line in log.read_text().splitlines(keepends=True)
                           if '"kind": "val"' not in line or '"step": 3' not in line))
    again = [r for r in drive([job], 4)["run"]["records"] if r["kind"] == "val" and r["step"] == 3]
    assert len(first) == len(again) == 1
    assert (again[0]["val_loss"], again[0]["val_bpb"]) == (first[0]["val_loss"], first[0]["val_bpb"])


def _compile_run(tmp_path, steps, extra=()):
    overrides = common(steps) + [
        "hardware.engine=xla", "trainer.device_batch_size=2", "trainer.log_every=10",
        "trainer.eval_every=20", "checkpoint.every=25", "optim.warmup_steps=5",
        "optim.warmdown_ratio=0.4", "optim.final_lr_frac=0.0", *extra]
    res = drive([{"name": "run", "dir": str(tmp_path / f"s{steps}"), "overrides": overrides}], 4)
    return res["run"]["records"]


# scan over layers (xtrain/xla/layers.py) traces its body with AOTAutograd inside the step: it
# must add no graph and no host transfer. Scan is off by default, so its case runs with `slow`
@pytest.mark.parametrize("scan", ["false", pytest.param("true", marks=pytest.mark.slow)])
def test_compilations_are_constant_and_host_syncs_only_at_log_points(tmp_path, scan):
    records = _compile_run(tmp_path, 100, [f"model.scan={scan}"])
    train = [r for r in records if "loss" in r]
    # 3 graphs in all: optimizer-state init, the training step, the validation step.
    # (An LR at 0.0/1.0 and the warmup/warmdown never add one: the LR is computed on device.)
    # (the validation graph is compiled at the first evaluation, after step 20's log line)
    # Every log line is checked: as many at step 50 as at step 100, through 4 evaluations and 3
    # checkpoints.
    assert [r["xla_compiles"] for r in train] == [2 if r["step"] <= 20 else 3 for r in train]
    assert [r["step"] for r in train][-6:] == [50, 60, 70, 80, 90, 100]
    for r in train:  # one transfer per log line and per evaluation; two per checkpoint
        step = r["step"]  # (the sharded snapshot: one for the shards, one for replicated tensors)
        logs = len([s for s in range(1, step + 1) if s == 1 or s % 10 == 0])
        evals = (step - 1) // 20  # an evaluation at step s runs after that step's log line
        ckpts = (step - 1) // 25
        assert r["host_syncs"] == logs + evals + 2 * ckpts, r
    lrs = [r["lr"] for r in train]
    assert lrs[-1] < lrs[len(lrs) // 2]  # warmdown happened


ORDER_DRIVER = r"""
import json, sys
import xtrain.xla.runtime as runtime
from tests.conftest import compose_cfg
from xtrain.modes import run
imported = []
export = runtime.apply_environment
def spy(hw):
    imported.append("torch_xla" in sys.modules)
    return export(hw)
runtime.apply_environment = spy
run(compose_cfg(sys.argv[2:], output_dir=sys.argv[1]), sys.argv[1])
print("IMPORTED " + json.dumps(imported))
"""


def test_the_profiles_environment_is_exported_before_torch_xla_is_imported(tmp_path):
    """On a TPU VM, ``import torch_xla`` fills LIBTPU_INIT_ARGS with torch_xla's defaults, and a
    variable already set is not overwritten (xtrain/xla/runtime.py): the profile's libtpu flags
    (conf/hardware/_tpu.yaml) reach the compiler only if the run exports them first."""
    r = subprocess.run([sys.executable, "-c", ORDER_DRIVER, str(tmp_path), *common(1),
                        "hardware.engine=xla", "parallelism=dp", "trainer.device_batch_size=2"],
                       cwd=ROOT, env={**os.environ, "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "2",
                                      "WANDB_MODE": "offline"},
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    line = [ln for ln in r.stdout.splitlines() if ln.startswith("IMPORTED ")][-1]
    assert json.loads(line[len("IMPORTED "):]) == [False]


def test_bad_mesh_fails_before_compiling(tmp_path):
    r = subprocess.run([sys.executable, "-m", "xtrain", "hardware.engine=xla", "parallelism=dp",
                        "parallelism.data=3", f"hydra.run.dir={tmp_path}"], cwd=ROOT,
                       env={**os.environ, "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "4"},
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert "mesh data=3 x fsdp=1 x tensor=1 = 3 devices, but the hardware has 4" in r.stderr
    assert not (tmp_path / "metrics.jsonl").exists()


# relative distance ||a - b|| / ||b|| per tensor, as for the CPU engine (tests/test_train.py).
# Measured after 3 steps: <= 2.6e-4, in the attention output projections (initialised to zero,
# so their norm is still small); one micro-batch dropped per step: > 1e-2.
XLA_ACCUM_REL, XLA_ACCUM_LOSS_ATOL = 1e-3, 1e-5


def test_accumulation_on_the_xla_engine_updates_like_one_bigger_batch(tmp_path):
    """Accumulation k (1 row per device per micro-batch, 4 devices) and accumulation 1 with k
    rows per device see the same rows and must make the same updates, for k = 2 and the real
    runs' 8: every parameter and optimizer-state tensor after 3 steps, and the losses."""
    steps, jobs = 3, []
    for k in (2, 8):
        base = common(steps) + ["hardware.engine=xla", "parallelism=dp"]
        jobs += [{"name": f"accum{k}", "dir": str(tmp_path / f"accum{k}"), "overrides": base + [
                     "trainer.device_batch_size=1", f"trainer.total_batch_size={k * 4 * SEQ}"]},
                 {"name": f"one{k}", "dir": str(tmp_path / f"one{k}"), "overrides": base + [
                     f"trainer.device_batch_size={k}"]}]
    results = drive(jobs, 4)
    for k in (2, 8):
        records = [[r for r in results[f"{name}{k}"]["records"] if "loss" in r] for name in ("accum", "one")]
        assert [r["tokens"] for r in records[0]] == [s * k * 4 * SEQ for s in range(1, steps + 1)]
        assert [r["tokens"] for r in records[1]] == [r["tokens"] for r in records[0]]
        assert max(abs(a["loss"] - b["loss"]) for a, b in zip(*records)) <= XLA_ACCUM_LOSS_ATOL, records
        final = [checkpoint_tensors(tmp_path / f"{name}{k}" / "checkpoints" / f"step_{steps:06d}")
                 for name in ("accum", "one")]
        worst = max(relative_differences(*final).items(), key=lambda kv: kv[1])
        assert worst[1] <= XLA_ACCUM_REL, (k, worst)


RECOMPILE_DRIVER = r"""
import sys
import torch
from tests.conftest import compose_cfg
from xtrain.data import batches
from xtrain.modes import run

steps = batches.StepBatches._steps

def shape_change_at_step_5(self):  # the test's fault: one row fewer from step 5 on
    for i, (tokens, state) in enumerate(steps(self)):
        yield (tokens[:, 1:] if i >= 4 else tokens), state

batches.StepBatches._steps = shape_change_at_step_5
cfg = compose_cfg(sys.argv[2:], output_dir=sys.argv[1])
run(cfg, sys.argv[1])
"""


def test_recompilation_guard_stops_the_run_naming_the_graph(tmp_path):
    overrides = common(10) + ["hardware.engine=xla", "trainer.device_batch_size=2",
                              "trainer.max_compiles=1"]
    env = {**os.environ, "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "2"}
    r = subprocess.run([sys.executable, "-c", RECOMPILE_DRIVER, str(tmp_path), *overrides], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode != 0
    assert ("RecompileError: trainer.max_compiles=1: the training step compiled graph 2 at step 5: "
            "xtrain_train_step") in r.stderr
    assert "(torch_xla: torch_xla.compile)" in r.stderr
    steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()
             if '"loss"' in line]
    assert max(steps) == 5  # stopped at the step that recompiled, not at the end (10)


def test_cpp_evaluation_leaves_the_training_steps_compile_count_unchanged(tmp_path):
    """The evaluation generates on a CPU copy of the weights: no graph is traced on the device."""
    from test_evals_model import EVAL, PROBLEMS

    problems = tmp_path / "cpp.jsonl"
    problems.write_text("".join(json.dumps(p) + "\n" for p in PROBLEMS))
    overrides = common(10) + ["hardware.engine=xla", "trainer.device_batch_size=2",
                              "eval.cpp_every=5", f"eval.cpp_file={problems}", *EVAL]
    records = drive([{"name": "run", "dir": str(tmp_path / "run"), "overrides": overrides}], 4)
    records = records["run"]["records"]
    assert [r["step"] for r in records if r["kind"] == "eval"] == [5, 10]
    # optimizer-state init and the training step; the validation graph comes after step 10's line
    assert [r["xla_compiles"] for r in records if "loss" in r] == [2] * 10
