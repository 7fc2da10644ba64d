"""Every bad input is refused quickly, in one line, with the documented exit code, and touches no
file it did not mean to: config values, data, checkpoints, meshes, sharding rules, environment.

Each case is a real ``python -m xtrain`` process. The "world" around it (a corpus in the cache, a
run with a committed checkpoint, a half-written checkpoint, ...) is hashed before and after.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from xtrain.errors import EXIT_REFUSED

ROOT = Path(__file__).resolve().parent.parent
TINY = ["model=d2", "model.sequence_len=64", "trainer.device_batch_size=4", "trainer.sample_tokens=0",
        "trainer.eval_tokens=256", "trainer.log_every=1"]

CASES = [  # (id, overrides, extra environment, what the one line must say)
    # Hydra composition: unknown options, keys, types, choices
    ("unknown-option", ["hardware=v9x"], {}, "Available options in 'hardware': cpu, cpu2, v4_32"),
    ("unknown-model", ["model=d3"], {}, "Could not find 'model/d3'"),
    ("unknown-logger", ["logger=[jsonl,wandbb]"], {},  # a list-valued group: Hydra names no options
     "Could not load 'logger/wandbb'; available options in 'logger': jsonl, many_loggers, "
     "tensorboard, wandb"),
    ("unknown-key", ["optim.lrr=1"], {}, "optim.lrr: Key 'lrr' not in 'OptimConfig'"),
    # '+' adds a key Hydra's schema check would refuse without it; nothing would read it
    ("added-unknown-key", ["+trainer.max_step=5"], {},
     "trainer.max_step (did you mean trainer.max_steps?): the config has no such key"),
    ("added-unknown-top-key", ["+foo=1"], {}, "foo: the config has no such key"),
    # a group's option: null was Hydra's traceback; a list merged the options into one run
    ("null-group", ["logger=null"], {}, "logger=null: a config group takes one of its options, not "
     "null (metrics.jsonl is always written: logger=jsonl adds no other)"),
    ("null-preset", ["+debug=null"], {}, "+debug=null: a config group takes one of its options, not null"),
    ("list-for-one", ["model=[d2,d4]"], {}, "model=[d2,d4]: model takes one option (a list merges "
     "them into one run); to train each, sweep them: -m model=d2,d4"),
    # the CPU engine's estimate against this machine's memory (none has 548 TiB)
    ("host-memory", ["model.depth=1000"], {}, "config error: does not fit this machine: memory/chip: "),
    ("host-memory-processes", ["model=d16"], {"LOCAL_WORLD_SIZE": "1024"},
     " x 1024 process(es) here: the weights, gradients and optimizer state alone take "),
    # a run's name is one directory: not outputs/ itself, not outside it (checked before Hydra
    # makes it), nor once an interpolation is resolved
    ("run-name-empty", ["run.name="], {}, "run.name='': a run's name must be one plain directory"),
    ("run-name-climbs", ["run.name=../escaped"], {}, "run.name='../escaped': a run's name must"),
    ("run-name-quoted", ["run.name='..'"], {}, "run.name='..': a run's name must"),
    ("run-name-interpolated", ["run.name=d${{model.depth}}/x"], {}, "run.name='d2/x': a run's"),
    ("wrong-type", ["trainer.max_steps=abc"], {}, "trainer.max_steps: Value 'abc'"),
    ("bad-override", ["trainer.max_steps=[1"], {}, "cannot parse override 'trainer.max_steps=[1'"),
    ("unknown-mode", ["mode=nope"], {}, "mode: Invalid value 'nope'"),
    ("unknown-attention", ["model.attention=nope"], {}, "model.attention: Invalid value 'nope'"),
    ("tpu-profile-on-the-cpu-engine", ["hardware=v6e4", "hardware.engine=cpu", "mode=plan"], {},
     "hardware.engine=cpu with hardware=v6e4: the cpu engine would run on the host's CPU and "
     "leave the v6e-4 TPU unused"),
    ("splash-head-dim", ["hardware=v6e4", "model=d4", "model.window_pattern=SL",
                         "model.attention=flash", "mode=plan"], {},
     "model.head_dim=64: layers [0, 2] run splash attention on the TPU (model.attention=flash, "
     "model.window_pattern), whose kernel takes head_dim in multiples of 128; use a head_dim of "
     "128, or a model.window_pattern without sliding-window layers, or model.attention=sdpa"),
    ("splash-head-dim-all", ["hardware=v6e4", "model=d4", "model.attention=splash", "mode=plan"], {},
     "whose kernel takes head_dim in multiples of 128; use a head_dim of 128, or "
     "model.attention=flash with full-context layers only, or model.attention=sdpa"),
    ("sweep-with-cfg", ["-m", "--cfg", "job"], {},
     "xtrain: config error: --cfg with --multirun: Hydra takes one of --run, --multirun, --cfg"),
    # Hydra's parser's refusals, one line instead of its usage
    ("not-an-option", ["--cfgg", "job"], {}, "--cfgg: not an option of Hydra's (--hydra-help"),
    ("overrides-both-sides", ["-m", "model=d2,d4"], {},  # (TINY's overrides come first)
     "model=d2,d4: Hydra reads the overrides as one run, which an option (-m, --cfg, ...) ended"),
    ("cfg-choice", ["--cfg", "nope"], {}, "argument --cfg/-c: invalid choice: 'nope'"),
    ("flash-on-cpu", ["model.attention=flash"], {},
     "model.attention=flash: the Pallas kernels need a TPU (hardware.engine=cpu)"),
    ("sample-no-prompts", ["mode=sample", "sample.prompts=[]"], {},
     "sample.prompts=[]: nothing to sample"),
    ("sample-tokens-fill-context", ["trainer.sample_tokens=64"], {},  # before data or the model
     "trainer.sample_tokens=64 leaves no room for a prompt in model.sequence_len=64"),
    ("eval-tokens-fill-context", ["eval.cpp_every=5", "eval.max_tokens=64"], {},
     "eval.max_tokens=64 leaves no room for a prompt in model.sequence_len=64"),
    ("eval-std-in-flags", ["eval.cpp_every=5", "eval.flags=[-O1,'-std=c++11']"], {},
     "eval.flags: -std=c++11 would replace eval.std=c++17; set the standard with eval.std"),
    ("unknown-engine", ["hardware.engine=gpu"], {}, "hardware.engine: Invalid value 'gpu'"),
    ("unknown-precision", ["hardware.precision=fp8"], {}, "hardware.precision: Invalid value 'fp8'"),
    ("unknown-experiment", ["+experiment=nope"], {}, "Available options in 'experiment': v5e8_d16_1024"),
    ("experiment-without-plus", ["experiment=v6e4_d16_16k"], {}, "use +experiment=v6e4_d16_16k"),
    # a base that options extend (conf/hardware/_tpu.yaml) is no option of its own
    ("base-hardware", ["hardware=_tpu"], {},
     "hardware=_tpu: a base that the group's options extend, not an option to choose"),
    ("base-data", ["data=_gcs_nanochat"], {}, "data=_gcs_nanochat: a base that the group's options"),
    # ranges declared beside each field (xtrain/config/)
    ("device-batch-0", ["trainer.device_batch_size=0"], {}, "trainer.device_batch_size=0: must be >= 1"),
    ("device-batch-neg", ["trainer.device_batch_size=-1"], {}, "trainer.device_batch_size=-1: must be >= 1"),
    ("max-steps-0", ["trainer.max_steps=0"], {}, "trainer.max_steps=0: must be >= 1"),
    ("xla-cpu-hosts", ["hardware=cpu2", "hardware.engine=xla"], {},
     "hardware=cpu2 has hosts: 2, and XLA on CPU is one process"),
    ("total-batch", ["trainer.total_batch_size=3000"], {}, "trainer.total_batch_size=3,000 is not a multiple"),
    ("log-every-0", ["trainer.log_every=0"], {}, "trainer.log_every=0: must be >= 1"),
    ("eval-every-neg", ["trainer.eval_every=-1"], {}, "trainer.eval_every=-1: must be >= 0"),
    ("eval-tokens-0", ["trainer.eval_tokens=0"], {}, "trainer.eval_tokens=0: must be >= 1"),
    ("matrix-lr-neg", ["optim.matrix_lr=-1"], {}, "optim.matrix_lr=-1: must be >= 0"),
    ("embedding-lr-neg", ["optim.embedding_lr=-0.1"], {}, "optim.embedding_lr=-0.1: must be >= 0"),
    ("beta1", ["optim.adam_beta1=1.5"], {}, "optim.adam_beta1=1.5: must be < 1"),
    ("eps-0", ["optim.adam_eps=0"], {}, "optim.adam_eps=0: must be > 0"),
    ("warmdown", ["optim.warmdown_ratio=1.5"], {}, "optim.warmdown_ratio=1.5: must be <= 1"),
    # Lightning's seed_everything takes 32 bits (and a sample's generator 64, seed + prompt)
    ("seeds", ["trainer.seed=4294967296", "sample.seed=18446744073709551615"], {},
     "trainer.seed=4294967296: must be <= 4294967295; sample.seed=18446744073709551615: must be <= "
     "4294967295"),
    ("final-lr", ["optim.final_lr_frac=2"], {}, "optim.final_lr_frac=2: must be <= 1"),
    ("grad-clip", ["optim.grad_clip=-1"], {}, "optim.grad_clip=-1: must be >= 0"),
    ("ns-steps", ["optim.muon_ns_steps=0"], {}, "optim.muon_ns_steps=0: must be >= 1"),
    ("keep-last-0", ["checkpoint.keep_last=0"], {}, "checkpoint.keep_last=0: must be >= 1 (to keep every"),
    ("keep-last-neg", ["checkpoint.keep_last=-1"], {}, "checkpoint.keep_last=-1: must be >= 1"),
    ("every-neg", ["checkpoint.every=-1"], {}, "checkpoint.every=-1: must be >= 0"),
    ("retries-neg", ["checkpoint.retries=-1"], {}, "checkpoint.retries=-1: must be >= 0"),
    ("depth-0", ["model.depth=0"], {}, "model.depth=0: must be >= 1"),
    ("head-dim", ["model.head_dim=48"], {}, "model.head_dim=48 does not divide the width 128"),
    ("kv-heads", ["model.n_kv_head=3"], {}, "model.n_kv_head=3 must divide n_head=4"),
    ("window-pattern", ["model.window_pattern=SQL"], {}, "model.window_pattern='SQL'"),
    ("seq-0", ["model.sequence_len=0"], {}, "model.sequence_len=0: must be >= 1"),
    ("softcap-0", ["model.softcap=0"], {}, "model.softcap=0: must be > 0"),
    ("vocab-disagrees", ["model.vocab_size=5000"], {}, "model.vocab_size=5000 disagrees with the tokenizer"),
    ("prefetch-0", ["data.prefetch=0"], {}, "data.prefetch=0: must be >= 1"),
    # meshes, sharding rules and engines
    ("cpu-engine-fsdp", ["parallelism=fsdp_tp"], {}, "the cpu engine replicates every parameter"),
    ("cpu-engine-tensor", ["parallelism.tensor=3"], {}, "parallelism=dp with parallelism.tensor=3 "
     "shards parameters: the cpu engine replicates every parameter; use parallelism=dp as it is"),
    ("mesh-size", ["hardware.engine=xla", "parallelism.data=3"], {"CPU_NUM_DEVICES": "4"},
     "mesh data=3 x fsdp=1 x tensor=1 = 3 devices, but the hardware has 4"),
    ("two-free-axes", ["hardware.engine=xla", "parallelism.fsdp=-1"], {"CPU_NUM_DEVICES": "4"},
     "at most one -1"),
    ("unknown-axis", ["hardware.engine=xla", "+parallelism.rules=[[wte,[pipeline,null]]]"],
     {"CPU_NUM_DEVICES": "4"}, "uses mesh axis 'pipeline'"),
    ("bad-regex", ["hardware.engine=xla", "parallelism=fsdp", "parallelism.rules=[['(',[fsdp,null]]]"],
     {"CPU_NUM_DEVICES": "4"}, "bad regex"),
    ("spec-rank", ["hardware.engine=xla", "parallelism=fsdp", "parallelism.rules=[[wte,[fsdp]]]"],
     {"CPU_NUM_DEVICES": "4"}, "has 1 entries, the parameter has 2 dims"),
    ("devices-not-a-number", ["hardware.engine=xla"], {"CPU_NUM_DEVICES": "abc"}, "CPU_NUM_DEVICES='abc'"),
    # hardware profiles and this machine
    ("tpu-here", ["hardware=v6e4", "trainer.max_steps=1"], {}, "this machine has no TPU chip"),
    ("chips", ["hardware=v4_32", "hardware.chips=32"], {}, "v4-32 has 16 chips"),
    ("topology", ["hardware=v6e4", "hardware.topology=null"], {}, "is missing hardware.topology"),
    # data
    ("no-shards-dir", ["data.build_sources=[]", "data.train_files={missing}", "data.tokenizer={tokenizer}"],
     {}, "{missing}: no such directory"),
    ("empty-shards", ["data.build_sources=[]", "data.train_files={empty}", "data.tokenizer={tokenizer}"],
     {}, "{empty}: no parquet shards found"),
    ("holdout-one-shard", ["data.build_sources=[]", "data.train_files={one_shard}",
                           "data.tokenizer={tokenizer}", "data.holdout_last_shard=true", "data.val_files=null"],
     {}, "holdout_last_shard needs at least 2 shards, found 1"),
    ("unreachable-val-bucket", ["data.build_sources=[]", "data.train_files={corpus}/train",
                                "data.tokenizer={tokenizer}", "data.val_files=gs://xtrain-val/val",
                                "data.remote_timeout_s=0.5"],
     {"STORAGE_EMULATOR_HOST": "http://127.0.0.1:9"}, "storage error: gs://xtrain-val: no answer within 0.5 s"),
    # validation on shards train_files also matches (a directory, a glob spanning both)
    ("val-trained-on", ["data.build_sources=[]", "data.train_files={corpus}/train",
                        "data.tokenizer={tokenizer}", "data.holdout_last_shard=false",
                        "data.val_files={first_shard}"], {},
     "data.val_files={first_shard}: 1 shard(s) also in data.train_files={corpus}/train "
     "(first {first_shard}): validation would score text the run trains on"),
    ("no-tokenizer", ["data.build_sources=[]", "data.tokenizer={missing}"], {},
     "data.tokenizer={missing}: no such directory"),
    ("half-tokenizer", ["data.build_sources=[]", "data.tokenizer={half_tokenizer}"], {},
     "needs tokenizer.json (or tokenizer.pkl) and token_bytes.pt"),
    ("no-sources", ["data.build_sources=[{empty}]"], {}, "no C/C++ sources found"),
    ("missing-source", ["data.build_sources=[{one_source},{missing}]"], {},
     "data.build_sources=['{one_source}', '{missing}']: {missing} does not exist"),
    ("one-source", ["data.build_sources=[{one_source}]"], {},
     "data.build_sources=['{one_source}']: only one C/C++ source file ({one_source}/only.cpp); "
     "the build holds out whole files for validation, so it needs at least 2"),
    # a corpus built on first use that this run would build anew over the one its checkpoint
    # trained on (the build deleted those shards, then the resume was refused)
    ("rebuild-under-resume", ["checkpoint.dir={checkpoints}", "run.name={run_name}",
                              "data.build_dir={corpus}", "data.chunk_tokens=128"], {},
     "data error: {committed} was trained on the corpus in data.build_dir={corpus}, which this run "
     "would build anew, replacing the shards the checkpoint trained on: data.chunk_tokens=128 "
     "(built with 256)"),
    ("rewind-to-nothing", ["checkpoint.rewind=true"], {},
     "checkpoint.rewind=true goes back to checkpoint.resume's step, which is not set"),
    ("built-nowhere", ["data=base_data_v3", "data.build_sources=[{two_sources}]"], {},
     "data.build_sources=['{two_sources}']: the corpus is built into data.build_dir, which is null"),
    ("built-corpus-elsewhere", ["data.train_files=/nonexistent/x"], {},  # data=cpp_local builds
     "but data.train_files=/nonexistent/x reads elsewhere: to read shards of your own, also set "
     "data.build_sources=[]"),
    ("unreachable-bucket", ["data=cpp16k", "data.remote_timeout_s=0.5"],
     {"STORAGE_EMULATOR_HOST": "http://127.0.0.1:9"}, "storage error: gs://nanochat-training-data-2026: no answer within 0.5 s"),
    # on several processes the C++ evaluation reads the checkpoint of its step
    # (xtrain/train/cpp_eval.py): a profile of 2 hosts, or hardware=cpu under torchrun
    ("cpp-eval-between-checkpoints", ["hardware=cpu2", "eval.cpp_every=3", "checkpoint.every=2"],
     {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "WORLD_SIZE": "2", "RANK": "0"},
     "eval.cpp_every=3 on 2 processes: the evaluation reads the weights of the checkpoint of its "
     "step, so it must be a multiple of checkpoint.every (now 2)"),
    ("cpp-eval-between-checkpoints-torchrun", ["eval.cpp_every=3", "checkpoint.every=2"],
     {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "WORLD_SIZE": "2", "RANK": "0"},
     "eval.cpp_every=3 on 2 processes: the evaluation reads the weights of the checkpoint of its "
     "step, so it must be a multiple of checkpoint.every (now 2)"),
    # the evaluation's own checks, before data, checkpoints or the model are read
    ("eval-k-above-n-in-training", ["eval.cpp_every=5", "eval.k=[2]"], {},
     "eval.k=[2]: each k must be in 1..eval.n=1"),
    ("eval-greedy-samples", ["mode=eval", "eval.n=4"], {},  # (the run dir has no checkpoint)
     "eval.n=4 with eval.temperature=0: greedy decoding gives n identical samples"),
    # settings nothing would read
    ("val-files-and-holdout", ["data=cpp16k", "data.val_files=gs://bucket/val"], {},
     "data.val_files=gs://bucket/val with data.holdout_last_shard=true: validation would read "
     "the last train shard"),
    ("env-on-cpu-engine", ["+hardware.env.OMP_NUM_THREADS=1"], {},
     "hardware.env sets OMP_NUM_THREADS: the XLA runtime's environment, which the cpu engine"),
    # the launcher's fields, before anything is copied
    ("launcher-range", ["hardware=v6e4", "hydra/launcher=tpu_vm", "hydra.launcher.hosts=[127.0.0.9]",
                        "hydra.launcher.retries=-1", "hydra.launcher.port=0",
                        "hydra.launcher.lock_wait_s=inf"], {},
     "hydra.launcher.port=0: must be >= 1; hydra.launcher.retries=-1: must be >= 0; "
     "hydra.launcher.lock_wait_s=inf: must be <= 604800"),
    ("launcher-added-unknown-key", ["hardware=v6e4", "hydra/launcher=tpu_vm",
                                    "hydra.launcher.hosts=[127.0.0.9]", "+hydra.launcher.retrys=3"], {},
     "hydra.launcher.retrys (did you mean hydra.launcher.retries?): the config has no such key"),
    # checkpoints
    ("resume-missing", ["checkpoint.resume={missing}"], {}, "checkpoint.resume={missing}: no such directory"),
    ("resume-empty", ["checkpoint.resume={empty}"], {}, "not a committed checkpoint"),
    ("resume-uncommitted", ["checkpoint.resume={uncommitted}"], {}, "not a committed checkpoint (no COMMITTED"),
    ("resume-run-dir", ["checkpoint.resume={checkpoints}"], {}, "it holds checkpoints: point at one"),
    # the data position it holds is for its seed: refused before data preparation, not after
    ("resume-other-seed", ["checkpoint.resume={committed}", "trainer.seed=7"], {},
     "checkpoint error: {committed} was trained with trainer.seed=42, this run's is 7: the data "
     "position it holds is for that seed; resume with trainer.seed=42"),
    ("continue-other-seed", ["checkpoint.dir={checkpoints}", "run.name={run_name}", "trainer.seed=7"], {},
     "checkpoint error: {committed} was trained with trainer.seed=42, this run's is 7"),
    ("resume-other-model", ["model=d4", "checkpoint.resume={committed}"], {},
     "checkpoint.resume={committed} holds a different model (n_layer 2 -> 4, n_embd 128 -> 256): "
     "give the model it was trained with, or a checkpoint of this model"),
    ("cpu2-without-launch-variables", ["hardware=cpu2"], {"MASTER_ADDR": "", "RANK": ""},
     "hardware=cpu2 runs 2 processes; MASTER_ADDR, MASTER_PORT, WORLD_SIZE, RANK not set"),
    # the rendezvous variables, read as digits only (int() took "0_2"; torch refused the port
    # with a traceback at start); a RANK left set turned off a one-process run's lock and record
    ("world-size-not-digits", ["hardware=cpu2"],
     {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "WORLD_SIZE": "0_2", "RANK": "0"},
     "WORLD_SIZE='0_2': expected an integer >= 1"),
    ("port-out-of-range", ["hardware=cpu2"],
     {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "99999", "WORLD_SIZE": "2", "RANK": "0"},
     "MASTER_PORT='99999': expected an integer in 1..65535"),
    ("rank-of-a-one-process-run", [], {"RANK": "1"},
     "RANK='1' but hardware=cpu runs one process: unset RANK"),
    ("rank-of-a-one-process-xla-run", ["hardware.engine=xla"], {"RANK": " 0"},
     "RANK=' 0' but hardware=cpu runs one process: unset RANK"),
    # a profile's hosts as the TPU type has them (the plan split the batch over 3 hosts of 6)
    ("hosts-of-a-pod", ["hardware=v4_32", "hardware.hosts=3", "hardware.chips_per_host=6"], {},
     "hardware=v4_32: a v4-32 is 4 host(s) of 4 chips, profile says 3 x 6"),
    ("hosts-of-a-v6e-8", ["hardware=v6e8", "hardware.hosts=2", "hardware.chips_per_host=4"], {},
     "hardware=v6e8: a v6e-8 is 1 host(s) of 8 chips, profile says 2 x 4"),
    ("cpp-eval-without-its-compiler", ["eval.cpp_every=5", "eval.gxx=g++-nowhere"], {},
     "eval.gxx='g++-nowhere': compiler not found on PATH"),
    ("cpp-eval-file-missing", ["eval.cpp_every=5", "eval.cpp_file=/nonexistent/cpp.jsonl"], {},
     "C++ benchmark file /nonexistent/cpp.jsonl does not exist"),  # before the corpus and model
    ("wandb-online-without-key", ["logger=[jsonl,wandb]", "logger.wandb.mode=online"],
     {"WANDB_API_KEY": "", "WANDB_BASE_URL": "https://wandb.invalid"},  # no key, none in ~/.netrc
     "logger.wandb.mode=online but no W&B key: export WANDB_API_KEY"),
    ("wandb-project-w&b-refuses", ["logger=[jsonl,wandb]", "logger.wandb.project=team/proj"], {},
     "logger.wandb.project='team/proj': W&B takes names of up to 128 characters, none of / \\ # ? % :"),
    ("wandb-empty-tag", ["logger=[jsonl,wandb]", "logger.wandb.tags=[a,'']"], {},
     "logger.wandb.tags: '' has 0 characters; W&B takes tags of 1 to 64"),
    ("wandb-tag-too-long", ["logger=[jsonl,wandb]", f"logger.wandb.tags=[{'t' * 65}]"], {},
     f"logger.wandb.tags: '{'t' * 65}' has 65 characters"),
    ("tensorboard-name-a-path", ["logger=[jsonl,tensorboard]", "logger.tensorboard.name=../out"], {},
     "logger.tensorboard.name='../out': one directory's name under <run dir>/tensorboard, no path"),
    ("tensorboard-version-a-path-in-a-plan", ["logger=[jsonl,tensorboard]", "mode=plan",
                                              "logger.tensorboard.version=a/b"], {},
     "logger.tensorboard.version='a/b': one directory's name"),
    ("logger-not-selected", ["logger.wandb.project=x"], {},
     "logger.wandb.project: logger.wandb is not part of this config (null): select it first, "
     "e.g. logger=[jsonl,wandb]"),
    ("data-vocab-below-bytes", ["data.vocab_size=10"], {},
     "data.vocab_size=10: must be >= 257 (a byte-level BPE's 256 bytes and <|bos|>)"),
    ("sample-top-k", ["mode=sample", "sample.top_k=0"], {}, "sample.top_k=0: must be >= 1"),
    ("eval-range", ["mode=eval", "sample.temperature=-1"], {}, "sample.temperature=-1: must be >= 0"),
    ("checkpoint-dir-of-another-run", ["run.name=other", "checkpoint.dir={checkpoints}"], {},
     "{checkpoints}/step_000002 belongs to run d2-cpu-cpp_local-model.sequence_len_64-"
     "trainer.device_batch_size_4, not to this run (other): give each run its own checkpoint.dir "
     "(e.g. .../ckpt/${{run.name}}); to continue from it on purpose, set "
     "checkpoint.resume={checkpoints}/step_000002 with a checkpoint.dir of this run's own"),
    # a resume named does not make another run's dir this run's: its retention would delete them
    ("resume-into-the-dir-of-another-run", ["run.name=other", "checkpoint.dir={checkpoints}",
                                            "checkpoint.resume={checkpoints}/step_000002"], {},
     "{checkpoints}/step_000002 belongs to run d2-cpu-cpp_local-model.sequence_len_64-"
     "trainer.device_batch_size_4, not to this run (other): give each run its own checkpoint.dir"),
    ("checkpoint-dir-blocked", ["checkpoint.dir={a_file}/ckpt"], {}, "checkpoint.dir {a_file}/ckpt is not writable"),
]


def tree_digest(*roots: Path) -> dict[str, str]:
    out = {}
    for root in roots:
        for path in sorted(root.rglob("*")):
            if path.is_file():
                out[str(path)] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


@pytest.fixture(scope="module")
def world(tmp_path_factory, xtrain_cache):
    """A corpus in the cache and a finished d2 run with a committed checkpoint, plus the odd
    paths the cases point at."""
    base = tmp_path_factory.mktemp("world")
    run = base / "run"
    r = subprocess.run([sys.executable, "-m", "xtrain", *TINY, "trainer.max_steps=2",
                        f"hydra.run.dir={run}"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    checkpoints = run / "checkpoints"
    committed = sorted(checkpoints.glob("step_*"))[-1]
    uncommitted = base / "uncommitted"
    shutil.copytree(committed, uncommitted)
    (uncommitted / "COMMITTED").unlink()
    corpus = next(p for p in (Path(xtrain_cache) / "corpus").glob("cpp_local-*") if p.is_dir())
    one_shard = base / "one_shard"
    one_shard.mkdir()
    shutil.copy(sorted((corpus / "train").glob("*.parquet"))[0], one_shard)
    half_tokenizer = base / "half_tokenizer"
    half_tokenizer.mkdir()
    shutil.copy(corpus / "tokenizer" / "tokenizer.json", half_tokenizer)
    (base / "empty").mkdir()
    (base / "one_source").mkdir()
    (base / "one_source" / "only.cpp").write_text("int main() { return 0; }\n")
    (base / "two_sources").mkdir()
    for name in ("a.cpp", "b.cpp"):
        (base / "two_sources" / name).write_text(f"int {name[0]}() {{ return 0; }}\n")
    (base / "a_file").write_text("")
    paths = dict(missing=base / "missing", empty=base / "empty", a_file=base / "a_file",
                 checkpoints=checkpoints, committed=committed, uncommitted=uncommitted,
                 tokenizer=corpus / "tokenizer", one_shard=one_shard, half_tokenizer=half_tokenizer,
                 one_source=base / "one_source", two_sources=base / "two_sources",
                 first_shard=sorted((corpus / "train").glob("*.parquet"))[0])
    run_name = json.loads((committed / "meta.json").read_text())["config"]["run"]["name"]
    return {"base": base, "corpus": corpus, "run_name": run_name, **{k: str(v) for k, v in paths.items()}}


def import_torch_s() -> float:
    """Seconds a process takes here to import torch: a refusal comes before any such work (the
    data, the model, torch itself), so it must take less. Measured in the same session, as a
    fixed limit failed on a slow or loaded machine."""
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import torch"], check=True, timeout=300)
    return time.perf_counter() - t0


@pytest.fixture(scope="module")
def torch_import_s():
    return import_torch_s()


def before_torch_could_import(seconds: float, torch_import_s: float) -> bool:
    """``seconds`` under the session's torch import, or else under one measured again at once,
    under this moment's load (the other worker's)."""
    return seconds < torch_import_s or seconds < import_torch_s()


# Config errors found by xtrain/inputs.py beside the inputs it reads, once the run dir is taken
# (its console.log says why); every other config error leaves no run dir
CHECKED_WITH_INPUTS = {"cpp-eval-between-checkpoints", "cpp-eval-between-checkpoints-torchrun",
                       "resume-other-model", "checkpoint-dir-of-another-run",
                       "resume-into-the-dir-of-another-run",
                       "checkpoint-dir-blocked"}


@pytest.mark.parametrize("case, overrides, env, expected", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_refused_fast_in_one_line(case, overrides, env, expected, world, tmp_path,
                                               torch_import_s):
    overrides = [o.format(**world) for o in overrides]
    before = tree_digest(world["base"], world["corpus"])
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "xtrain", *TINY, *overrides, f"hydra.run.dir={tmp_path}/run"],
                       cwd=ROOT, capture_output=True, text=True, timeout=60,
                       env={**os.environ, "PJRT_DEVICE": "CPU", **env})
    seconds = time.perf_counter() - t0
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode == EXIT_REFUSED, r.stderr[-3000:]
    assert len(lines) == 1 and lines[0].startswith("xtrain: "), r.stderr[-3000:]
    assert expected.format(**world) in lines[0]
    assert before_torch_could_import(seconds, torch_import_s), \
        f"refused after {seconds:.2f} s, slower than importing torch ({torch_import_s:.2f} s, and again)"
    assert tree_digest(world["base"], world["corpus"]) == before  # nothing it did not mean to touch
    # nor its own record: also one refused after it took the run dir (inputs, checkpoints)
    assert not list((tmp_path / "run").glob(".hydra*")), sorted((tmp_path / "run").iterdir())
    if lines[0].startswith("xtrain: config error") and case not in CHECKED_WITH_INPUTS:
        assert not (tmp_path / "run").exists(), sorted((tmp_path / "run").iterdir())


def test_a_checkpoint_trained_with_another_tokenizer_is_not_resumed(world, tmp_path, torch_import_s):
    """Same run name, same vocabulary size, two token ids swapped: the run's checkpoints hold a
    model whose ids mean other text, and resuming would train on garbage without a word."""
    import json

    run, tok = tmp_path / "run", tmp_path / "tokenizer"
    shutil.copytree(Path(world["checkpoints"]).parent, run)
    saved = json.loads((run / "checkpoints" / "step_000002" / "meta.json").read_text())["config"]
    shutil.copytree(saved["data"]["tokenizer"], tok)  # the run's own (the cache may hold others)
    spec = json.loads((tok / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[300:302]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (tok / "tokenizer.json").write_text(json.dumps(spec))
    corpus, name = Path(saved["data"]["tokenizer"]).parent, saved["run"]["name"]
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "xtrain", *TINY, "trainer.max_steps=4",
                        f"run.name={name}", "data.build_sources=[]", f"data.tokenizer={tok}",
                        f"data.train_files={corpus}/train", f"data.val_files={corpus}/val",
                        f"hydra.run.dir={run}"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    seconds = time.perf_counter() - t0
    assert r.returncode == EXIT_REFUSED, r.stderr[-3000:]
    assert r.stderr.splitlines()[-1].startswith(
        f"xtrain: checkpoint error: {run}/checkpoints/step_000002 was trained with the tokenizer of "
        f"{corpus}/tokenizer (sha256 ")
    assert "its token ids mean other text" in r.stderr and "resuming from" not in r.stdout
    # refused with the other input checks, before the data and the model are prepared
    assert len(r.stderr.splitlines()) == 1, r.stderr[-3000:]
    assert before_torch_could_import(seconds, torch_import_s), (seconds, torch_import_s)


def test_a_run_is_not_resumed_over_changed_sources_whose_build_would_replace_its_corpus(tmp_path,
                                                                                         torch_import_s):
    """A run whose corpus is built on first use, and one of data.build_sources' files edited
    since: its next command would build the corpus anew in place (deleting the shards the run
    trained on) and only then refuse the resume, as the data differs. Refused before the build:
    the corpus and the checkpoints stay as they were."""
    [bits] = Path("/usr/include/c++").glob("*/bits")
    shutil.copytree(bits, tmp_path / "sources")
    run, corpus = tmp_path / "run", tmp_path / "corpus"
    command = [sys.executable, "-m", "xtrain", *TINY, "trainer.max_steps=2", "data.vocab_size=512",
               f"data.build_sources=[{tmp_path / 'sources'}]", f"data.build_dir={corpus}",
               f"hydra.run.dir={run}"]
    r = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    with open(tmp_path / "sources" / "stl_pair.h", "a") as f:
        f.write("// edited after the run trained\n")
    before = tree_digest(corpus, run / "checkpoints")
    t0 = time.perf_counter()
    r = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)  # again
    seconds = time.perf_counter() - t0
    assert r.returncode == EXIT_REFUSED, r.stderr[-3000:]
    assert r.stderr.splitlines() == [
        f"xtrain: data error: {run}/checkpoints/step_000002 was trained on the corpus in "
        f"data.build_dir={corpus}, which this run would build anew, replacing the shards the "
        f"checkpoint trained on: the files under data.build_sources=['{tmp_path / 'sources'}'] "
        f"changed since (its build read {len(list(bits.iterdir()))} files); to resume, put them back "
        "as they were; to train on the new corpus, start a new run (another run.name)"]
    assert tree_digest(corpus, run / "checkpoints") == before
    assert before_torch_could_import(seconds, torch_import_s), (seconds, torch_import_s)


def test_a_refused_command_leaves_the_runs_record_and_an_accepted_one_replaces_it(world, tmp_path):
    """A run dir's .hydra/ says what trained there: a refused command in that dir does not
    replace it; an accepted one does (here one resumed past its last step: not a silent success
    either)."""
    run = tmp_path / "run"
    shutil.copytree(Path(world["checkpoints"]).parent, run)
    overrides = run / ".hydra" / "overrides.yaml"
    trained = overrides.read_text()
    assert "trainer.max_steps=2" in trained
    r = subprocess.run([sys.executable, "-m", "xtrain", *TINY, "checkpoint.keep_last=0",
                        f"hydra.run.dir={run}"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == EXIT_REFUSED, r.stderr[-3000:]
    assert overrides.read_text() == trained
    r = subprocess.run([sys.executable, "-m", "xtrain", *TINY, "trainer.max_steps=1",
                        f"hydra.run.dir={run}"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert (f"xtrain: warning: {run}/checkpoints/step_000002 is at step 2, past this run's last "
            "step 1 (trainer.max_steps): nothing to train") in r.stderr, r.stderr[-3000:]
    assert "trainer.max_steps=1" in overrides.read_text() and not (run / ".hydra-pending").exists()


@pytest.mark.parametrize("overrides, code", [
    (["model.depth=0"], EXIT_REFUSED), (["hardware=_tpu"], EXIT_REFUSED),
    (["+trainer.max_step=5"], EXIT_REFUSED), (["trainer.sample_tokens=64"], EXIT_REFUSED),
    (["model=d20", "hardware.hbm_gib_per_chip=1"], EXIT_REFUSED),  # does not fit
    (["trainer.max_steps=${oc.env:XTRAIN_TEST_UNSET}"], EXIT_REFUSED),
    (["hydra.run.dir=gs://b/runs/x"], EXIT_REFUSED), (["-m", "hydra.sweep.dir=gs://b/sweeps"], EXIT_REFUSED),
    (["hydra.run.dir=file:///tmp/xtrain-test-file-url/x"], EXIT_REFUSED),
    (["RANK=1", "checkpoint.keep_last=0"], EXIT_REFUSED),  # (a process other than the first)
    (["mode=plan"], 0), (["mode=plan", "checkpoint.dir=/tmp/ckpt/${run.name}"], 0),
    # what the training would refuse, mode=plan does too
    (["mode=plan", "trainer.sample_tokens=64"], EXIT_REFUSED),
    (["mode=plan", "eval.cpp_every=10", "eval.n=2"], EXIT_REFUSED)],
    ids=["range", "base", "unknown-key", "sampling", "fit", "unresolvable", "url-run-dir", "url-sweep-dir",
         "file-url-run-dir", "rank-1", "plan", "plan-interpolated", "plan-sampling", "plan-eval"])
def test_a_command_that_keeps_nothing_leaves_no_run_dir(tmp_path, overrides, code):
    """Hydra makes outputs/<run> and writes the command's record there before xtrain sees the
    config: a command refused by its config checks, or mode=plan, takes both away again, and
    outputs/ if it made that too (a process other than the first writes no record: the dirs)."""
    env = dict(o.split("=") for o in overrides if o.startswith("RANK="))
    overrides = [o for o in overrides if not o.startswith("RANK=")]
    flags = [o for o in overrides if o.startswith("-")]  # before the overrides, as Hydra parses them
    r = subprocess.run([sys.executable, "-m", "xtrain", *flags, *TINY, *(o for o in overrides if o not in flags)],
                       cwd=tmp_path, capture_output=True, text=True, timeout=120,
                       env={**os.environ, **env})
    assert r.returncode == code, r.stderr[-3000:]
    assert len(r.stderr.splitlines()) == (1 if code else 0), r.stderr  # the refusal's line alone
    assert list(tmp_path.iterdir()) == []


def test_a_refused_command_in_a_used_run_dir_removes_only_its_own_record(tmp_path):
    """In a run dir that holds other things, a refused command removes the record Hydra wrote for
    it, nothing else (the case of another command's record: tests/test_hydra_record.py)."""
    run = tmp_path / "run"
    (run / "keep").mkdir(parents=True)
    r = subprocess.run([sys.executable, "-m", "xtrain", *TINY, "model.depth=0", f"hydra.run.dir={run}"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == EXIT_REFUSED, r.stderr[-3000:]
    assert sorted(p.name for p in run.iterdir()) == ["keep"]
    # a record dir set by hand (here the run dir itself) is not xtrain's to remove
    r = subprocess.run([sys.executable, "-m", "xtrain", *TINY, "model.depth=0", f"hydra.run.dir={run}",
                        "hydra.output_subdir=."], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == EXIT_REFUSED, r.stderr[-3000:]
    assert sorted(p.name for p in run.iterdir()) == ["config.yaml", "hydra.yaml", "keep", "overrides.yaml"]


def test_a_refused_command_leaves_the_dirs_it_did_not_make(tmp_path):
    """An empty dir prepared for runs stays when a refused command (or mode=plan) removes the run
    dir Hydra made in it, and so does an empty run dir that was there before the command;
    outputs/, which Hydra made, goes (test above)."""
    (tmp_path / "experiments" / "mine").mkdir(parents=True)
    (tmp_path / "prepared" / "run").mkdir(parents=True)
    for args in (["model.depth=0"], ["mode=plan"]):
        for run_dir in ("experiments/mine/run", "prepared/run"):
            r = subprocess.run([sys.executable, "-m", "xtrain", *TINY, *args, f"hydra.run.dir={run_dir}"],
                               cwd=tmp_path, capture_output=True, text=True, timeout=120)
            assert r.returncode in (0, EXIT_REFUSED), r.stderr[-3000:]
            assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*")) == [
                "experiments", "experiments/mine", "prepared", "prepared/run"], (args, run_dir)


@pytest.mark.parametrize("name", ["d${model.depth}/x", "..", "${oc.env:XTRAIN_TEST_NAME}", "a" * 256])
def test_a_bad_run_name_is_refused_before_hydra_makes_its_directory(tmp_path, name):
    """Without hydra.run.dir, Hydra makes outputs/<run.name> (and writes its record there) before
    xtrain sees the config: the name, interpolations resolved, is checked as Hydra reads it
    (conf/train.yaml), so nothing is left behind ("${oc.env:...}" giving ".." would write into
    the working directory itself)."""
    r = subprocess.run([sys.executable, "-m", "xtrain", *TINY, "mode=plan", f"run.name={name}"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "XTRAIN_TEST_NAME": ".."})
    assert r.returncode == EXIT_REFUSED, r.stderr[-3000:]
    assert r.stderr.splitlines()[-1].startswith("xtrain: config error: run.name="), r.stderr
    assert "a run's name must be one plain directory name" in r.stderr.splitlines()[-1]
    assert list(tmp_path.iterdir()) == []


def test_a_secret_on_the_command_line_is_refused_before_hydra_writes_anything(tmp_path, monkeypatch):
    """Its value would be in the run's name, .hydra/, multirun.yaml and the process list."""
    from xtrain.config.secrets import check_no_secret_overrides
    from xtrain.errors import ConfigError

    value = "hf_" + os.urandom(8).hex()
    for key, name, args in (
            ("hardware.env.HF_TOKEN", "HF_TOKEN", ["mode=plan", f"+hardware.env.HF_TOKEN={value}"]),
            ("hardware.env.MY_API_KEY", "MY_API_KEY",
             ["-m", "mode=plan", f"++hardware.env.MY_API_KEY={value}", "optim.matrix_lr=0.01,0.02"]),
            ("hardware.env", "HF_TOKEN", ["mode=plan", f"hardware.env={{XLA_FLAGS: x, HF_TOKEN: {value}}}"]),
            ("hardware.env", "HF_TOKEN", ["mode=plan", f"hardware.env={{'HF_TOKEN': '{value}'}}"]),
            ("hardware.env.hfToken", "hfToken", ["mode=plan", f"+hardware.env.hfToken={value}"]),
            # a dict in a dict (a pattern reading pairs took {WANDB_API_KEY:... for X's value)
            ("hydra.job.env_set", "WANDB_API_KEY",
             ["mode=plan", f"+hydra.job.env_set={{X:{{WANDB_API_KEY:{value}}}}}"]),
            # an AWS secret access key (base64) may start with a slash: no file, no path's name
            ("hardware.env.AWS_SECRET_ACCESS_KEY", "AWS_SECRET_ACCESS_KEY",
             ["mode=plan", f"+hardware.env.AWS_SECRET_ACCESS_KEY=/{value}"])):
        r = subprocess.run([sys.executable, "-m", "xtrain", *args], cwd=tmp_path, capture_output=True,
                           text=True, timeout=60)
        assert r.returncode == EXIT_REFUSED, r.stderr[-3000:]
        assert r.stderr.startswith(f"xtrain: config error: {key}: a secret is never given on the "
                                   "command line") and f"export {name} " in r.stderr
        assert value not in r.stdout + r.stderr
        assert list(tmp_path.iterdir()) == []  # no outputs/ or multirun/
    # a value of a secret's form, under a key that says nothing
    for key, arg in (("hydra.launcher.pip_args", "hydra.launcher.pip_args=['--index-url=https://ci:"
                                                 f"{value}@pypi.example.com/simple']"),
                     ("hardware.env.GH_LOGIN", f"+hardware.env.GH_LOGIN=ghp_{'A1b2' * 9}")):
        r = subprocess.run([sys.executable, "-m", "xtrain", "mode=plan", arg], cwd=tmp_path,
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == EXIT_REFUSED, r.stderr[-3000:]
        assert r.stderr.startswith(f"xtrain: config error: {key}: a secret is never given on the "
                                   "command line") and "pass it in an environment variable instead" in r.stderr
        assert list(tmp_path.iterdir()) == []
    # a secret environment variable's value, as the shell expands it, under a key that says nothing
    key_value = os.urandom(20).hex()  # (a W&B key's form: 40 hex digits, none of SECRET_VALUE's)
    r = subprocess.run([sys.executable, "-m", "xtrain", "mode=plan", f"+hardware.env.WB={key_value}"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=60,
                       env={**os.environ, "WANDB_API_KEY": key_value})
    assert r.returncode == EXIT_REFUSED, r.stderr[-3000:]
    assert r.stderr.startswith("xtrain: config error: hardware.env.WB: a secret is never given on "
                               "the command line") and key_value not in r.stdout + r.stderr
    assert list(tmp_path.iterdir()) == []
    monkeypatch.setenv("WANDB_API_KEY", key_value)
    with pytest.raises(ConfigError, match="hardware.env: a secret is never given"):
        check_no_secret_overrides([f"hardware.env={{'WB': 'x{key_value}'}}"])  # Hydra cannot parse it
    monkeypatch.delenv("WANDB_API_KEY")
    # at any depth, in a list or a sweep's choices, and in text Hydra cannot parse (quoted keys)
    for arg in (f"+hardware.env.X=[{{a: 1}}, {{hf_token: {value}}}]", f"+a.b=x,{{b: {{API_KEY: {value}}}}}",
                f"+a={{'b': {{'HF_TOKEN': '{value}'}}}}"):
        with pytest.raises(ConfigError, match="a secret is never given on the command line"):
            check_no_secret_overrides([arg])
    # flags and paths under such names are no secrets, as in a config file, nor a value reading
    # the environment (Hydra records it unresolved)
    check_no_secret_overrides(["hardware.env={HF_HUB_DISABLE_IMPLICIT_TOKEN: '1', XLA_FLAGS: x}",
                               "hardware.env={X: {HF_HUB_DISABLE_IMPLICIT_TOKEN: '1'}}",
                               "+hardware.env.HF_TOKEN=${oc.env:HF_TOKEN}"])
    # (and reading a secret into a secret-named key, as the refusals advise: Hydra records the
    # override's text under hydra.overrides, where it is judged by its own key)
    r = subprocess.run([sys.executable, "-m", "xtrain", "hardware=v6e4", "mode=plan",
                        "+hardware.env.HF_HUB_DISABLE_IMPLICIT_TOKEN=1",
                        "+hardware.env.GOOGLE_APPLICATION_CREDENTIALS=/home/me/service-account.json",
                        "+hardware.env.HF_TOKEN=${oc.env:HF_TOKEN}"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=60,
                       env={**os.environ, "HF_TOKEN": value})
    assert r.returncode == 0, r.stderr[-3000:]
    assert value not in r.stdout + r.stderr


def test_a_secret_variable_read_into_a_field_not_named_secret_is_refused(tmp_path, monkeypatch):
    """``run.name=${oc.env:WANDB_API_KEY}`` reads the key into the run's name, its dir and W&B's
    record, none of which is masked by its name: refused, on the command line and in a config
    file, as is a variable a launcher forwards as a secret (XTRAIN_SECRET_NAMES). Read into a
    secret-named key (masked wherever it is written), or a variable that is no secret, it runs."""
    from omegaconf import OmegaConf

    from xtrain.config.secrets import SECRET_NAMES_VAR, check_no_secret_overrides, check_no_secret_values
    from xtrain.errors import ConfigError

    key_value = os.urandom(20).hex()
    r = subprocess.run([sys.executable, "-m", "xtrain", "mode=plan", "run.name=${oc.env:WANDB_API_KEY}"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=60,
                       env={**os.environ, "WANDB_API_KEY": key_value})
    assert r.returncode == EXIT_REFUSED, r.stderr[-3000:]
    assert r.stderr.startswith("xtrain: config error: run.name: a secret is never given on the "
                               "command line") and "read WANDB_API_KEY only into a key whose name " \
                                                   "says secret" in r.stderr
    assert key_value not in r.stdout + r.stderr and list(tmp_path.iterdir()) == []
    # read into a secret-named key, then from there into the run's name: refused by its value
    r = subprocess.run([sys.executable, "-m", "xtrain", "mode=plan", "hardware=v6e1",
                        "+hardware.env.WANDB_API_KEY=${oc.env:WANDB_API_KEY}",
                        "run.name=${hardware.env.WANDB_API_KEY}"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=60,
                       env={**os.environ, "WANDB_API_KEY": key_value})
    assert r.returncode == EXIT_REFUSED, r.stderr[-3000:]
    assert r.stderr.startswith("xtrain: config error: run.name: resolves to a secret's value")
    assert key_value not in r.stdout + r.stderr and list(tmp_path.iterdir()) == []
    monkeypatch.setenv(SECRET_NAMES_VAR, "HF_LOGIN")
    for arg in ("run.name=${oc.env:HF_LOGIN}", "+hardware.env.X=a-${oc.env:HF_TOKEN,none}",
                "hydra.launcher.pip_args=[--extra-index-url, '${oc.env:PIP_TOKEN}']"):
        with pytest.raises(ConfigError, match="a secret is never given on the command line"):
            check_no_secret_overrides([arg])
    with pytest.raises(ConfigError, match=r"^run\.name: a secret is never written into a config"):
        check_no_secret_values(OmegaConf.create({"run": {"name": "${oc.env:WANDB_API_KEY}"}}))
    check_no_secret_overrides(["+hardware.env.HF_LOGIN_TOKEN=${oc.env:HF_LOGIN}",
                               "run.name=${oc.env:USER}", "+hardware.env.X=${oc.env:HOME}"])
    check_no_secret_values(OmegaConf.create({"run": {"name": "${oc.env:USER}"},
                                             "env": {"WANDB_API_KEY": "${oc.env:WANDB_API_KEY}"}}))


@pytest.mark.parametrize("printing", [["--cfg", "job", "--resolve", "-p", "hardware.env"],
                                      ["--help", "--resolve"], ["-h", "--resolve"]],
                         ids=["cfg", "help", "h"])
def test_the_config_hydra_prints_resolved_shows_secrets_masked(tmp_path, printing):
    """``--cfg job --resolve`` prints what ``${oc.env:HF_TOKEN}`` reads: masked; so does the help
    page, which shows the config."""
    secret = "hf_" + os.urandom(16).hex()
    r = subprocess.run([sys.executable, "-m", "xtrain", "hardware=v6e4",
                        "+hardware.env.HF_TOKEN=${oc.env:HF_TOKEN}", *printing], cwd=tmp_path,
                       capture_output=True, text=True, timeout=60,
                       env={**os.environ, "HF_TOKEN": secret})
    assert r.returncode == 0, r.stderr[-3000:]
    assert "HF_TOKEN: '***'" in r.stdout or "HF_TOKEN: ***" in r.stdout, r.stdout
    assert "PJRT_DEVICE: TPU" in r.stdout and secret not in r.stdout + r.stderr


def test_the_completion_of_a_field_set_from_a_secret_shows_it_masked(tmp_path):
    """Shell completion offers a field's value, resolved: one read from ``${oc.env:HF_TOKEN}`` is
    offered masked."""
    secret = "hf_" + os.urandom(16).hex()
    line = "xtrain +hardware.env.HF_TOKEN=${oc.env:HF_TOKEN} hardware.env.HF_TOKEN="
    r = subprocess.run([sys.executable, "-m", "xtrain", "-sc", "query=bash"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=60,
                       env={**os.environ, "HF_TOKEN": secret, "COMP_LINE": line,
                            "COMP_POINT": str(len(line))})
    assert r.returncode == 0, r.stderr[-3000:]
    assert "hardware.env.HF_TOKEN=" in r.stdout and secret not in r.stdout + r.stderr, r.stdout


def test_a_refusal_or_warning_quoting_a_secret_shows_it_masked(tmp_path, monkeypatch, capsys):
    """A config may read a variable holding a secret's value from the environment (one named as
    a secret is refused before, read into a field that is not: here a copy, under another name);
    refused where it was read into the wrong field, the refusal's line quotes the value: masked,
    as warnings are."""
    secret = "xtrain-test-" + os.urandom(8).hex()
    env = {**os.environ, "XTRAIN_TEST_TOKEN": secret, "XTRAIN_TEST_COPY": secret}
    for arg, line in (("model.depth=${oc.env:XTRAIN_TEST_COPY}",
                       "xtrain: config error: model.depth: While dereferencing interpolation "
                       "'${oc.env:XTRAIN_TEST_COPY}': Value '***' of type 'str' could not be "
                       "converted to Integer"),
                      ("run.name=${oc.env:XTRAIN_TEST_COPY}/x",
                       "xtrain: config error: run.name='***/x': a run's name must be one plain "
                       "directory name")):
        r = subprocess.run([sys.executable, "-m", "xtrain", "mode=plan", arg], cwd=tmp_path,
                           capture_output=True, text=True, timeout=60, env=env)
        assert r.returncode == EXIT_REFUSED, r.stderr[-3000:]
        assert r.stderr.splitlines()[-1].startswith(line), r.stderr[-3000:]
        assert secret not in r.stdout + r.stderr
    from xtrain.errors import warn

    monkeypatch.setenv("XTRAIN_TEST_TOKEN", secret)  # (this process imported xtrain.cli: masked)
    warn(f"could not reach https://example.com/?token={secret}")
    assert capsys.readouterr().err == "xtrain: warning: could not reach https://example.com/?token=***\n"
    # an exception in a thread (a library's) and a Python warning, once the CLI's main has run
    code = ("import os, sys, threading, warnings\nfrom xtrain import cli\n"
            "sys.argv = ['xtrain', '--cfg', 'job']\ncli.main()\n"
            "def fails():\n    int('in a thread: ' + os.environ['XTRAIN_TEST_TOKEN'])\n"
            "t = threading.Thread(target=fails)\nt.start()\nt.join()\n"
            "warnings.warn('a library warns: ' + os.environ['XTRAIN_TEST_TOKEN'])\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
                       timeout=60, env=env)
    assert r.returncode == 0 and "ValueError: invalid literal for int() with base 10: 'in a thread: ***'" in r.stderr, r.stderr
    assert "UserWarning: a library warns: ***" in r.stderr, r.stderr
    assert secret not in r.stdout + r.stderr


def test_the_corpus_builders_refusal_quoting_a_secret_shows_it_masked(tmp_path):
    """``python -m xtrain.data build`` is an entry point of its own, outside the Hydra app: its
    one-line refusals are masked as the app's are (a directory named after a token, say)."""
    secret = "xtrain-test-" + os.urandom(8).hex()
    (out := tmp_path / f"out-{secret}").mkdir()
    (out / "keep.txt").write_text("not a corpus build")
    (src := tmp_path / "src").mkdir()
    r = subprocess.run([sys.executable, "-m", "xtrain.data", "build", str(src), "--out", str(out)],
                       cwd=tmp_path, capture_output=True, text=True, timeout=60,
                       env={**os.environ, "XTRAIN_TEST_TOKEN": secret})
    assert r.returncode == EXIT_REFUSED, r.stderr[-3000:]
    assert f"{tmp_path}/out-*** is not an xtrain corpus build" in r.stderr, r.stderr[-3000:]
    assert secret not in r.stdout + r.stderr


def test_hydras_rerun_which_unpickles_a_file_is_refused(tmp_path):
    """``--experimental-rerun FILE`` would unpickle FILE: a crafted one runs code."""
    import pickle

    marker = tmp_path / "code-ran"

    class Payload:
        def __reduce__(self):
            return os.system, (f"touch {marker}",)

    crafted = tmp_path / "config.pickle"
    crafted.write_bytes(pickle.dumps(Payload()))
    for args in (["--experimental-rerun", str(crafted)], [f"--experimental-re={crafted}"]):
        r = subprocess.run([sys.executable, "-m", "xtrain", *args], cwd=tmp_path,
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == EXIT_REFUSED, r.stderr[-3000:]
        assert r.stderr.startswith("xtrain: config error: --experimental-rerun: Hydra's re-run "
                                   "unpickles a file, which can run code")
        assert not marker.exists()


@pytest.mark.parametrize("options", [["--cfg", "job"], ["--cfg=job"], ["-c", "job"],
                                     ["--cf", "job"], ["-cjob"]])
def test_the_printed_config_is_masked_however_hydras_option_is_spelt(tmp_path, options):
    """Hydra's argparse takes a unique prefix of an option (``--cf``) and a short option's value
    attached (``-cjob``): both printed a secret unmasked when xtrain read options as written."""
    secret = "hf_" + os.urandom(16).hex()
    r = subprocess.run([sys.executable, "-m", "xtrain", "hardware=v6e4",
                        "+hardware.env.HF_TOKEN=${oc.env:HF_TOKEN}", *options, "--resolve", "-p",
                        "hardware.env"], cwd=tmp_path, capture_output=True, text=True, timeout=60,
                       env={**os.environ, "HF_TOKEN": secret})
    assert r.returncode == 0, r.stderr[-2000:]
    assert "HF_TOKEN: ***\n" in r.stdout, r.stdout
    assert secret not in r.stdout + r.stderr and os.listdir(tmp_path) == []


@pytest.mark.parametrize("args, modes", [
    (["--cfg", "job", "--multi", "model=d2,d4"], "--cfg with --multirun"),  # (Hydra's traceback)
    (["-mcjob", "model=d2,d4"], "--cfg with --multirun"),
    (["-rcjob"], "--cfg with --run"),
])
def test_two_hydra_modes_are_refused_however_spelt(tmp_path, args, modes):
    r = subprocess.run([sys.executable, "-m", "xtrain", *args], cwd=tmp_path, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == EXIT_REFUSED, r.stdout[-2000:] + r.stderr[-2000:]
    assert r.stderr.startswith(f"xtrain: config error: {modes}: Hydra takes one of --run, "
                               "--multirun, --cfg, --info, --shell-completion per command"), r.stderr
    assert len(r.stderr.splitlines()) == 1 and os.listdir(tmp_path) == []


def test_a_secret_in_a_config_file_is_refused_and_leaves_nothing(tmp_path):
    """A secret written into a config file would be copied into .hydra/, multirun.yaml and the code
    synced to TPU VMs; one read from the environment is not in any of them."""
    hardware = tmp_path / "conf" / "hardware"
    hardware.mkdir(parents=True)
    (hardware / "mine.yaml").write_text("defaults: [v6e4, _self_]\nenv:\n  HF_TOKEN: written-here\n")
    (tmp_path / "conf" / "experiment").mkdir()
    (tmp_path / "conf" / "experiment" / "in_hydra.yaml").write_text(
        "# @package _global_\nhydra:\n  job:\n    env_set:\n      HF_TOKEN: written-here\n")
    (hardware / "flags.yaml").write_text("defaults: [v6e4, _self_]\nenv:\n  HF_HUB_DISABLE_IMPLICIT_TOKEN: '1'\n"
                                         "  GOOGLE_APPLICATION_CREDENTIALS: /home/me/service-account.json\n")
    (hardware / "from_env.yaml").write_text("defaults: [v6e4, _self_]\nenv:\n"
                                            "  HF_TOKEN: ${oc.env:XTRAIN_TEST_HF_TOKEN}\n")
    work = tmp_path / "work"
    work.mkdir()
    for choice, code in (("hardware=mine", EXIT_REFUSED), ("+experiment=in_hydra", EXIT_REFUSED),
                         ("hardware=from_env", 0), ("hardware=flags", 0)):
        for sweep in ([], ["-m"]):
            r = subprocess.run([sys.executable, "-m", "xtrain", *sweep, "--config-dir", str(tmp_path / "conf"),
                                choice, "mode=plan"], cwd=work, capture_output=True,
                               text=True, timeout=120, env={**os.environ, "XTRAIN_TEST_HF_TOKEN": "from-env"})
            assert r.returncode == code, r.stderr[-3000:]
            if code:
                line = r.stderr.splitlines()[-1]  # a sweep's line names its job first
                assert line.startswith("xtrain: config error: ") and len(r.stderr.splitlines()) == 1, r.stderr
                key = "hydra.job.env_set" if "in_hydra" in choice else "hardware.env"
                assert f"{key}.HF_TOKEN: a secret is never written into a config" in line
                assert "export HF_TOKEN in the environment" in line
                assert "written-here" not in r.stdout + r.stderr
                assert list(work.iterdir()) == []  # no outputs/ or multirun/


def test_secrets_in_a_config_are_found_by_name_and_by_form_and_read_from_the_environment_only_where_resolved(
        monkeypatch):
    from omegaconf import OmegaConf

    from xtrain.config.secrets import check_no_secret_values
    from xtrain.errors import ConfigError

    monkeypatch.setenv("XTRAIN_TEST_HF_TOKEN", "from-env")
    monkeypatch.setenv("XTRAIN_TEST_VALUE", "from-the-environment")
    monkeypatch.setenv("WANDB_API_KEY", "0123456789abcdef" * 2)  # a secret of no particular form
    # URLs with a password are built in pieces here: a launcher refuses to sync a file holding one
    url = "https://ci:" + "s3cr3tT0k@pypi.example.com/simple"
    for config, key in (({"env": {"WANDB_API_KEY": "x" * 8}}, "env.WANDB_API_KEY"),
                        ({"pip_args": ["-q", f"--index-url={url}"]}, "pip_args[1]"),
                        ({"pip_args": ["--index-url=https://ci:" + "s3cr3t@${oc.env:HOME}"]}, "pip_args[0]"),
                        ({"pip_args": ["--index-url=https://${oc.env:HOME}:" + "s3cr3t@pypi.org"]}, "pip_args[0]"),
                        ({"a": {"b": [{"note": "ghp_" + "A1b2" * 9}]}}, "a.b[0].note")):
        with pytest.raises(ConfigError, match=rf"^hydra\.launcher\.{re.escape(key)}: a secret"):
            check_no_secret_values(OmegaConf.create(config), "hydra.launcher.")
    # look-alikes, short flags, paths, empty values and the environment read where the config
    # is kept unresolved
    check_no_secret_values(OmegaConf.create({
        "tokenizer": "bpe", "keep_last": "3", "url": "https://pypi.org/simple", "key_count": 3,
        "env": {"HF_TOKEN": "", "HF_HUB_DISABLE_IMPLICIT_TOKEN": "1", "GOOGLE_APPLICATION_CREDENTIALS":
                "/home/me/service-account.json", "AUTH_HEADER": "Bearer ${oc.env:XTRAIN_TEST_HF_TOKEN}"}}))
    monkeypatch.setenv("XTRAIN_TEST_COPY", "0123456789abcdef" * 2)  # WANDB_API_KEY's, under another name
    for key, name in (("HF_TOKEN", "XTRAIN_TEST_VALUE"), ("W", "XTRAIN_TEST_COPY")):  # by the key's name, by the value
        reads_env = OmegaConf.create({"env": {key: f"${{oc.env:{name}}}"}})
        check_no_secret_values(reads_env)
        with pytest.raises(ConfigError, match=f"^hydra.launcher.env.{key}: a secret"):  # written resolved
            check_no_secret_values(reads_env, "hydra.launcher.", resolved=True)
    monkeypatch.setenv("XTRAIN_TEST_CREDENTIALS", "/home/me/service-account.json")  # a path, no secret
    check_no_secret_values(OmegaConf.create({"env": {"W": "${oc.env:HOME}", "GOOGLE_APPLICATION_CREDENTIALS":
                                                     "${oc.env:XTRAIN_TEST_CREDENTIALS}",
                                                     "PIP_INDEX_URL": "https://ci:" + "${oc.env:HOME}@pypi.org"}}),
                           "hydra.launcher.", resolved=False)
    check_no_secret_values(OmegaConf.create({"env": {"W": "${oc.env:HOME}", "GOOGLE_APPLICATION_CREDENTIALS":
                                                     "${oc.env:XTRAIN_TEST_CREDENTIALS}"}}),
                           "hydra.launcher.", resolved=True)


def test_a_sweep_runs_from_a_checkout_whose_plugins_are_not_on_the_path(tmp_path):
    """A checkout run without `make setup`, or a job launched from its synced tree, has launch/
    (xtrain's Hydra plugins) off the path: a sweep still finds xtrain's sweeper."""
    code = ("import sys; sys.path[:] = [p for p in sys.path if not p.rstrip('/').endswith('launch')]; "
            "sys.argv = ['xtrain', *sys.argv[1:]]; from xtrain.cli import main; main()")
    r = subprocess.run([sys.executable, "-c", code, "-m", "mode=plan", "model=d2,d4",
                        f"hydra.sweep.dir={tmp_path}"], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "#0 : mode=plan model=d2" in r.stdout + r.stderr and "#1 : mode=plan model=d4" in r.stdout + r.stderr


def test_checkpoints_record_the_config_with_its_secrets_masked(compose_config):
    """A secret a config file put in the run's environment (hardware.env) stays out of meta.json."""
    from xtrain.train.run import run_meta

    cfg = compose_config(["+hardware.env.HF_TOKEN=hf_fromayamlfile", "+hardware.env.XLA_FLAGS=--x"])
    assert run_meta(cfg)["config"]["hardware"]["env"] == {"HF_TOKEN": "***", "XLA_FLAGS": "--x"}


def test_sample_tokens_must_leave_room_for_a_prompt_only_where_there_are_prompts(compose_config):
    from xtrain.errors import ConfigError
    from xtrain.modes import check_sampling

    full = ["model.sequence_len=64", "trainer.sample_tokens=64"]
    with pytest.raises(ConfigError, match="trainer.sample_tokens=64 leaves no room for a prompt"):
        check_sampling(compose_config(full))
    check_sampling(compose_config([*full, "sample.prompts=[]"]))  # nothing sampled in training
    check_sampling(compose_config(["model.sequence_len=64", "trainer.sample_tokens=63"]))


@pytest.mark.parametrize("overrides, said", [
    (["trainer.sample_tokens=62"], "+ trainer.sample_tokens=62 exceed the model's sequence_len 64"),
    (["eval.cpp_every=5"], "alone fills the model's sequence_len 64"),
], ids=["sample", "cpp-eval"])
def test_prompts_without_room_are_refused_before_the_model_or_a_checkpoint(world, tmp_path,
                                                                            overrides, said):
    """Counting a prompt's tokens needs the tokenizer, which a corpus build makes: refused once it
    is known, no longer after the loaders, the model, the resume's checkpoint and the run's
    records (repro/) were made, and a W&B run started."""
    r = subprocess.run([sys.executable, "-m", "xtrain", *TINY, *overrides,
                        f"hydra.run.dir={tmp_path}/run"], cwd=ROOT, capture_output=True,
                       text=True, timeout=300, env={**os.environ, "PJRT_DEVICE": "CPU"})
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode == EXIT_REFUSED and len(lines) == 1, r.stderr[-3000:]
    assert said in lines[0]
    assert not (tmp_path / "run" / "repro").exists(), sorted((tmp_path / "run").iterdir())


def test_the_documented_exit_code_is_in_the_readme():
    assert f"exit code {EXIT_REFUSED}" in (ROOT / "README.md").read_text()


def test_a_sweep_refuses_a_bad_job_before_running_any(tmp_path):
    """Job 2 of 2 is out of range: the sweep ends before job 1 trains (xtrain/sweeps.py), naming
    the job and its overrides; also when the sweep is launched one job per batch."""
    sweep = tmp_path / "sweep"
    args = ["-m", "model=d2", "model.sequence_len=64", "trainer.max_steps=2", "trainer.sample_tokens=0",
            "trainer.device_batch_size=4,0", f"hydra.sweep.dir={sweep}", "hydra.sweeper.max_batch_size=1"]
    started = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "xtrain", *args], cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == EXIT_REFUSED, r.stderr[-3000:]
    assert r.stderr.splitlines()[-1] == (
        "xtrain: config error: sweep job 2 of 2 (model=d2 model.sequence_len=64 trainer.max_steps=2 "
        "trainer.sample_tokens=0 trainer.device_batch_size=0): trainer.device_batch_size=0: must "
        "be >= 1; no job was run")
    assert not sweep.exists()  # no job's directory, nor Hydra's record of the sweep
    assert time.perf_counter() - started < 30  # before any torch import, let alone a step
    # in the default sweep dir, multirun/<sweep>/: neither it nor multirun/ is left
    r = subprocess.run([sys.executable, "-m", "xtrain", *args[:-2]], cwd=tmp_path, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == EXIT_REFUSED and "sweep job 2 of 2" in r.stderr, r.stderr[-3000:]
    assert list(tmp_path.iterdir()) == []


def test_a_sweep_refuses_a_job_too_big_for_this_machine_before_running_any(tmp_path):
    """The CPU engine's memory check depends on the config and this machine alone: a local sweep
    makes it for every job first (job 1 trained, then the sweep ended at job 2)."""
    r = subprocess.run([sys.executable, "-m", "xtrain", "-m", *TINY, "model.depth=2,96", "trainer.max_steps=1",
                        f"hydra.sweep.dir={tmp_path / 'sweep'}"], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == EXIT_REFUSED, r.stderr[-3000:]
    assert r.stderr.splitlines()[-1].startswith("xtrain: config error: sweep job 2 of 2 (")
    assert "does not fit this machine: memory/chip: " in r.stderr.splitlines()[-1]
    assert not (tmp_path / "sweep").exists()


@pytest.mark.parametrize("overrides, job, expected", [
    (["hardware=cpu,_v6e"], 2, "hardware=_v6e: a base that the group's options extend"),
    (["optim.matrix_lr=0.01,0.02", "+trainer.max_step=5"], 1,
     "trainer.max_step (did you mean trainer.max_steps?): the config has no such key"),
    (["run.name=ok,d${model.depth}/x"], 2, "run.name='d2/x': a run's name must be one plain"),
], ids=["base option", "added unknown key", "interpolated run name"])
def test_a_sweep_refuses_a_job_composed_wrong_before_running_any(tmp_path, overrides, job, expected):
    """In a sweep dir an earlier sweep used, its record (multirun.yaml) is left as it was."""
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    (sweep / "multirun.yaml").write_text("# an earlier sweep's\n")
    r = subprocess.run([sys.executable, "-m", "xtrain", "-m", *TINY, *overrides, "mode=plan",
                        f"hydra.sweep.dir={sweep}"], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == EXIT_REFUSED, r.stderr[-3000:]
    assert r.stderr.splitlines()[-1].startswith(f"xtrain: config error: sweep job {job} of 2 (")
    assert expected in r.stderr.splitlines()[-1]
    assert [p.name for p in sweep.iterdir()] == ["multirun.yaml"]  # no job's directory
    assert (sweep / "multirun.yaml").read_text() == "# an earlier sweep's\n"


def test_a_refusal_ends_in_its_one_line_while_a_timed_out_check_runs_in_native_code(tmp_path):
    """An input check past its deadline goes on in a daemon thread (xtrain/inputs.py within). At
    the interpreter's exit such a thread is stopped where it stands, and one inside torch's C++
    (or a storage client's native code) took the refused process down with SIGABRT after its
    line. Here the check loops through torch's autograd engine, which calls back into Python."""
    script = tmp_path / "refuse.py"
    script.write_text(
        "import time, torch\n"
        "from xtrain.errors import refuse\n"
        "from xtrain.deadline import within\n"
        "class Slow(torch.autograd.Function):\n"
        "    forward = staticmethod(lambda ctx, x: x * 2)\n"
        "    backward = staticmethod(lambda ctx, g: (time.sleep(0.001), g * 2)[1])\n"
        "def hangs_in_native_code():\n"
        "    while True:\n"
        "        Slow.apply(torch.ones(3, requires_grad=True)).sum().backward()\n"
        "try:\n"
        "    within(0.3, 'gs://bucket', hangs_in_native_code)\n"
        "except Exception as ex:\n"
        "    refuse(ex)\n")
    for _ in range(3):  # (without the fix, each of them aborted)
        r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
        lines = [line for line in r.stderr.splitlines() if line.strip()]
        assert r.returncode == EXIT_REFUSED, r.stderr[-2000:]
        assert lines == ["xtrain: storage error: gs://bucket: no answer within 0.3 s (network, or "
                         "credentials: gcloud auth application-default login); data.remote_timeout_s "
                         "sets the wait"], r.stderr[-2000:]


STOPPED_AT_ITS_WORK = """
import os, signal, sys
import xtrain.modes as modes
SIGNAL = getattr(signal, sys.argv.pop())  # (the command's last argument)
def stopped(*args, **kwargs):
    os.kill(os.getpid(), SIGNAL)
modes.compile_for_tpu = modes.show_plan = stopped
"""


@pytest.mark.parametrize("mode, hardware", [("plan", "cpu"), ("compile", "v6e4")])
@pytest.mark.parametrize("signal_name, code", [("SIGINT", 130), ("SIGTERM", 143)])
def test_a_mode_that_keeps_nothing_stopped_at_its_work_leaves_nothing(tmp_path, mode, hardware,
                                                                      signal_name, code):
    """Ctrl-C or SIGTERM during ``mode=plan`` or ``mode=compile`` (minutes of the TPU compiler):
    the run dir Hydra made goes as after its end, and the stop's line speaks of no checkpoint.
    The signal comes from inside the mode's work (a fault injected there)."""
    from conftest import with_fault

    # (SIGINT as a terminal sends it: a shell without job control, CI's, starts this suite with
    # it ignored, and a child keeps an ignored signal ignored)
    r = subprocess.run([sys.executable, "-c", with_fault(STOPPED_AT_ITS_WORK), *TINY,
                        f"hardware={hardware}", f"mode={mode}", signal_name],
                       cwd=tmp_path, capture_output=True, text=True, timeout=120,
                       preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert r.returncode == code, r.stderr[-3000:]
    assert r.stderr.splitlines()[-1].endswith(f"; mode={mode} keeps nothing"), r.stderr[-3000:]
    assert list(tmp_path.iterdir()) == []


def test_a_refused_command_leaves_nothing_also_with_hydra_full_error(tmp_path):
    """HYDRA_FULL_ERROR=1 shows a refusal's traceback before its one line, and the exit code
    stays a refusal's (scripts tell bad input from a crash by it); the run dir Hydra made, and its
    record of the command, are removed all the same."""
    r = subprocess.run([sys.executable, "-m", "xtrain", *TINY, "model.depth=0"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=120,
                       env={**os.environ, "HYDRA_FULL_ERROR": "1"})
    lines = r.stderr.strip().splitlines()
    assert r.returncode == EXIT_REFUSED and "Traceback" in r.stderr, r.stderr[-3000:]
    assert lines[-1].startswith("xtrain: ") and "model.depth=0" in lines[-1], r.stderr[-3000:]
    assert list(tmp_path.iterdir()) == []
