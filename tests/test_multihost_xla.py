"""The XLA engine as host 1 of a 4-host pod.

A multi-host TPU runtime cannot exist on this machine: torch_xla's CPU runtime does no
cross-process collectives (README.md, "Not yet"). So the run's processes are a stand-in reporting process
index 1 of 4 (replacing xtrain.xla.runtime.host_processes, the one seam for this), over a real
single-process torch_xla runtime with 4 virtual CPU devices, and the test checks what such a
host does: it is not global zero, writes no metrics, samples or checkpoint metadata, keeps only
host 1's rows of each global batch and hands them to torch_xla's per-host input sharding.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from test_multiprocess import free_port

pytest.importorskip("torch_xla")
ROOT = Path(__file__).resolve().parent.parent
ROWS = 4  # per device: 16 rows per global micro-batch over 4 devices; host 1 keeps rows 4..7

DRIVER = r"""
import json, sys, torch
import torch_xla.core.xla_model as xm
import xtrain.checkpoint.layout as layout
import xtrain.train.run as run_module
import xtrain.xla.runtime as runtime
from tests.conftest import compose_cfg
from xtrain.data import prepare
from xtrain.data.loader import PackedLoader
from xtrain.engines.processes import Processes
from xtrain.modes import run

class Host1Of4(Processes):
    # host 1 of 4; what the other hosts would answer: host 0's broadcast value is the one this
    # host passes (every host computes the same), and a vote is this host's own flag
    def __init__(self):
        super().__init__(rank=1, world=4)
        self.calls = []
    def barrier(self):
        self.calls.append("barrier")
    def broadcast(self, obj, src=0):
        self.calls.append("broadcast")
        return obj
    def vote(self, flag):
        self.calls.append("vote")
        return lambda: flag

host = Host1Of4()
runtime.host_processes = lambda timeout_s: host
# the shared-storage probe needs host 0 to write it, and no process here plays host 0
# (the check runs on real processes in tests/test_multiprocess.py)
layout.check_shared = lambda directory, processes: None
engines, sent = [], []
build_engine = run_module.build_engine
def keep_engine(*args):
    engines.append(build_engine(*args))
    return engines[-1]
run_module.build_engine = keep_engine
send = xm.send_cpu_data_to_device
def observe(datas, device, input_sharding=None):  # what reaches torch_xla, unchanged
    sent.append({"tokens": datas[0].clone(), "minibatch": input_sharding.minibatch,
                 "spec": [list(a) if isinstance(a, tuple) else a for a in input_sharding.partition_spec]})
    return send(datas, device, input_sharding=input_sharding)
xm.send_cpu_data_to_device = observe
import xtrain.train.sampling as sampling
generated, generate = [], sampling.generate
def count_generate(*args, **kwargs):  # samples are host 0's to make
    generated.append(1)
    return generate(*args, **kwargs)
sampling.generate = count_generate

out_dir, overrides = sys.argv[1], json.loads(sys.argv[2])
cfg = compose_cfg(overrides, output_dir=out_dir + "/run")
summary = run(cfg, out_dir + "/run")
strategy = engines[0].strategy
facts = {"is_global_zero": strategy.is_global_zero, "global_rank": strategy.global_rank,
         "world_size": strategy.world_size, "calls": sorted(set(host.calls)),
         "host_rows": [engines[0].host_rows.start, engines[0].host_rows.stop],
         "generated": len(generated)}
train = [s for s in sent if s["tokens"].dim() == 3]
loader = PackedLoader(cfg.data.train_files, prepare(cfg.data), cfg.model.sequence_len,
                      engines[0].global_rows, seed=cfg.trainer.seed, prefetch=1)
first_global = torch.from_numpy(next(iter(loader)))
torch.save({"facts": facts, "train": train, "first_global": first_global}, out_dir + "/facts.pt")
"""


def test_host_1_of_4_keeps_its_rows_feeds_them_per_host_and_writes_nothing_of_host_0s(tmp_path):
    overrides = ["model=d2", "model.sequence_len=64", "hardware.engine=xla", "parallelism=dp",
                 f"trainer.device_batch_size={ROWS}", "trainer.max_steps=3", "trainer.log_every=1",
                 "trainer.sample_tokens=8", "trainer.eval_tokens=1024", "checkpoint.every=2"]
    env = {**os.environ, "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "4"}
    r = subprocess.run([sys.executable, "-c", DRIVER, str(tmp_path), json.dumps(overrides)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-4000:]
    result = torch.load(tmp_path / "facts.pt", weights_only=True)
    facts = result["facts"]
    assert facts["is_global_zero"] is False
    assert (facts["global_rank"], facts["world_size"]) == (1, 4)
    assert {"barrier", "broadcast", "vote"} <= set(facts["calls"])  # Lightning's and xtrain's
    run_dir = tmp_path / "run"
    assert not (run_dir / "metrics.jsonl").exists() and facts["generated"] == 0
    steps = sorted((run_dir / "checkpoints").glob("step_*"))
    assert [s.name for s in steps] == ["step_000002", "step_000003"]
    for step in steps:  # its own shards, and none of host 0's files
        assert list((step / "tensors").glob("*.distcp"))
        assert sorted(p.name for p in step.iterdir()) == ["tensors"]
    # the rows of host 1 only: rows 4..7 of each 16-row global micro-batch
    assert facts["host_rows"] == [ROWS, 2 * ROWS]
    train = result["train"]
    assert len(train) == 3
    assert torch.equal(train[0]["tokens"][:, 0], result["first_global"][ROWS:2 * ROWS])
    for batch in train:  # [rows, micro-batches, T+1], through the per-host input sharding
        assert batch["tokens"].shape == (ROWS, 1, 65)
        assert batch["minibatch"] is True and batch["spec"] == [["data", "fsdp"], None, None]


HEARTBEAT = r"""
import torch.distributed as dist
import torch_xla.distributed.xla_backend  # registers xla://
from xtrain.engines.processes import joined

# torch_xla's own rendezvous, as xtrain/xla/runtime.py's host_processes joins a pod's hosts; on
# CPU it has one process, so the processes claim a world of 2 whose rank 1 never joins
dist.init_process_group("gloo", init_method="xla://")
processes = joined(0, 2, timeout_s=30)
print("vanished:", processes.vanished())
processes.close()
"""


def test_the_xla_rendezvous_store_carries_the_heartbeat_that_names_a_vanished_host():
    """A pod's hosts join through torch_xla's xla:// rendezvous, not env://: the heartbeat must
    find that store too, or a lost host ends with gloo's anonymous error instead of exit 3."""
    env = {**os.environ, "PJRT_DEVICE": "CPU", "MASTER_PORT": str(free_port())}
    r = subprocess.run([sys.executable, "-c", HEARTBEAT], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "vanished: rank 1 of 2: no heartbeat for 3 s" in r.stdout, r.stdout + r.stderr[-3000:]


def test_a_host_whose_launch_number_is_not_its_tpu_worker_number_is_refused():
    """The launchers number the hosts as listed (RANK; rank 0 holds the run dir's lock and writes
    its record), the TPU runtime by worker (process 0 writes the metrics and commits checkpoints):
    hosts listed out of worker order split process 0's work over two hosts. Refused."""
    from xtrain.errors import ConfigError
    from xtrain.xla.runtime import check_launch_order

    check_launch_order(1, 4, {"RANK": "1", "WORLD_SIZE": "4"})
    check_launch_order(0, 1, {})  # a single host started by hand
    for environ in ({"RANK": "0", "WORLD_SIZE": "4"}, {"RANK": "1", "WORLD_SIZE": "8"}):
        with pytest.raises(ConfigError, match=r"this host was launched as RANK=\d of WORLD_SIZE=\d, and "
                                              r"the XLA runtime counts it process 1 of 4: a TPU slice numbers its hosts"):
            check_launch_order(1, 4, environ)
