"""Generation with a KV cache (the same tokens as recomputing everything), its stop rules, and
``mode=sample`` on a checkpoint."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import TINY
from xtrain.model.config import GPTConfig
from xtrain.model.generate import generate, generate_ids, next_tokens
from xtrain.model.gpt import GPT

ROOT = Path(__file__).resolve().parent.parent


def random_model(**shape) -> GPT:
    """A small GPT whose every weight is random: the zero-initialised output projections would
    make every block the identity, and every layer's attention would go unused."""
    cfg = dict(n_layer=3, n_head=4, n_kv_head=2, n_embd=128, vocab_size=300, sequence_len=128,
               windows=(16, 8, None), attention="sdpa", attention_block=64, softcap=15.0)
    cfg.update(shape)
    torch.manual_seed(0)
    model = GPT(GPTConfig(**cfg))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


@pytest.mark.parametrize("shape", [{}, {"n_kv_head": 4, "windows": (None, None, None)}],
                         ids=["gqa-windows", "full"])
def test_kv_cache_gives_the_tokens_of_full_recomputation(shape):
    model = random_model(**shape)
    prompt = [5, 17, 42, 99, 3]
    # greedy, past the 16- and 8-token windows
    cached = generate_ids(model, prompt, n=2, max_tokens=100, temperature=0)
    full = generate_ids(model, prompt, n=2, max_tokens=100, temperature=0, kv_cache=False)
    assert cached == full and len(cached[0]) == 100 and len(set(cached[0])) > 5
    # sampled: the same generator draws, so the same tokens
    kw = dict(n=3, max_tokens=40, temperature=1.0, top_k=20, seed=7)
    sampled = generate_ids(model, prompt, **kw)
    assert sampled == generate_ids(model, prompt, kv_cache=False, **kw)
    assert len({tuple(r) for r in sampled}) == 3  # n rows are n different samples
    assert sampled == generate_ids(model, prompt, **kw)  # a seed repeats itself


def test_the_cache_logits_match_a_full_forward():
    from xtrain.model.generate import KVCache

    model = random_model().eval()
    ids = torch.randint(0, 300, (1, 60), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(ids)
        cache = KVCache(model.config, 1, 60, "cpu")
        parts = [model(ids[:, :20], kv_cache=cache)] + [model(ids[:, t:t + 1], kv_cache=cache)
                                                        for t in range(20, 60)]
    torch.testing.assert_close(torch.cat(parts, dim=1), full, rtol=1e-4, atol=1e-4)


def test_top_k_stop_tokens_stop_hook_and_the_context_limit():
    model = random_model()
    prompt = [5, 17, 42]
    for row in generate_ids(model, prompt, n=4, max_tokens=30, temperature=5.0, top_k=1, seed=3):
        assert row == generate_ids(model, prompt, max_tokens=30, temperature=0)[0]  # top-1 = greedy
    greedy = generate_ids(model, prompt, max_tokens=30, temperature=0)[0]
    stop_at = greedy[5]
    assert generate_ids(model, prompt, max_tokens=30, temperature=0, stop_ids={stop_at})[0] == \
        greedy[:greedy.index(stop_at)]
    assert generate_ids(model, prompt, max_tokens=30, temperature=0, stop=lambda ids: len(ids) == 4)[0] == greedy[:4]
    with pytest.raises(ValueError, match="must be 1..128 tokens"):
        generate_ids(model, list(range(100)), max_tokens=29)


class CharTokenizer:
    """One character per token (Latin-1), BOS = 256: the interface generate() needs."""

    bos_id = 256

    def encode(self, text):
        return list(text.encode("latin-1"))

    def decode(self, ids):
        return bytes(i for i in ids if i < 256).decode("latin-1")


def test_a_tiny_temperature_samples_the_likeliest_token():
    """Divided by 1e-40, the float32 logits overflowed to inf and the softmax gave NaN."""
    logits = torch.randn(4, 4096) * 30
    for temperature, top_k in [(1e-40, None), (1e-40, 50), (1e-46, None)]:  # (the last: 0 in fp32)
        ids = next_tokens(logits, temperature, top_k, torch.Generator().manual_seed(0))
        assert torch.equal(ids, logits.argmax(dim=-1, keepdim=True))


def test_generate_gives_n_texts_per_prompt_with_a_text_stop_hook():
    model = random_model(vocab_size=257)
    stats = {}
    texts = generate(model, CharTokenizer(), ["ab", "xyz"], 3, max_tokens=12, temperature=1.0,
                     top_k=None, seed=1, stats=stats)
    assert [len(t) for t in texts] == [3, 3] and stats["tokens"] > 0 and stats["seconds"] > 0
    # each prompt has its own seed: its completions do not depend on the other prompts
    assert generate(model, CharTokenizer(), ["xyz"], 3, max_tokens=12, temperature=1.0, top_k=None,
                    seed=2) == texts[1:]
    stopped = generate(model, CharTokenizer(), ["ab"], 1, max_tokens=12, temperature=0,
                       stop=lambda text: len(text) >= 3)
    assert len(stopped[0][0]) == 3


def test_the_evaluations_completions_fit_the_context_when_max_tokens_is_unset():
    from xtrain.config import EvalConfig
    from xtrain.evals.completions import model_generate

    model = random_model(vocab_size=257, sequence_len=40)
    with torch.no_grad():
        model.lm_head.weight.zero_()  # every logit 0: greedy picks token 0, a NUL, for ever
    prompt = "int f() {\n"  # 10 characters, BOS first: 29 tokens of room in a 40-token context
    (texts,) = model_generate(model, CharTokenizer(), EvalConfig())([prompt], 1)
    assert texts == ["\0" * 29]
    (texts,) = model_generate(model, CharTokenizer(), EvalConfig(max_tokens=5))([prompt], 1)
    assert texts == ["\0" * 5]
    # a long context: the default budget of 384 tokens, not the 389 the context leaves
    long_context = random_model(vocab_size=257, sequence_len=400)
    with torch.no_grad():
        long_context.lm_head.weight.zero_()
    (texts,) = model_generate(long_context, CharTokenizer(), EvalConfig())([prompt], 1)
    assert texts == ["\0" * 384]


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("trained")
    r = subprocess.run([sys.executable, "-m", "xtrain", *TINY, "trainer.max_steps=30", "checkpoint.every=20",
                        f"hydra.run.dir={run_dir}"], cwd=ROOT, capture_output=True, text=True,
                       timeout=600, env={**os.environ, "WANDB_MODE": "offline"})
    assert r.returncode == 0, r.stderr[-3000:]
    return run_dir


def _sample(run_dir, *args):
    return subprocess.run([sys.executable, "-m", "xtrain", *TINY, "mode=sample", *args,
                           f"hydra.run.dir={run_dir}"], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)


def test_mode_sample_prints_text_from_the_runs_newest_checkpoint(trained_run):
    r = _sample(trained_run, "sample.n=2", "sample.max_tokens=24", "sample.prompt='int main('")
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"sampling {trained_run}/checkpoints/step_000030" in r.stdout
    samples = r.stdout.split("--- prompt 'int main(', sample ")[1:]
    assert len(samples) == 2 and all(s.split("\n", 1)[1].startswith("int main(") for s in samples)
    assert len(samples[0].split("\n", 1)[1]) > len("int main(") + 10  # it wrote something
    assert " tok/s (KV cache, CPU)" in r.stdout
    assert "runs the checkpoint's model" not in r.stderr  # this config's model is the same
    # explicit checkpoint, greedy: deterministic
    ckpt = f"checkpoint.resume={trained_run}/checkpoints/step_000030"
    greedy = [_sample(trained_run, ckpt, "sample.temperature=0", "sample.max_tokens=16").stdout
              for _ in range(2)]
    texts = [g.split("--- prompt")[1:] for g in greedy]
    texts = [t[:-1] + [t[-1].rsplit("\n", 2)[0]] for t in texts]  # without the tok/s line
    assert len(texts[0]) == 2 and texts[0] == texts[1]


def test_mode_sample_of_a_named_checkpoint_logs_with_the_run_it_belongs_to(trained_run, tmp_path):
    """Not in the dir of the run the command's groups would train (outputs/d4-cpu-cpp_local-...).
    The command gives no model (the default group's is another): nothing to warn of."""
    no_model = [a for a in TINY if not a.startswith("model")]
    r = subprocess.run([sys.executable, "-m", "xtrain", *no_model, "mode=sample", "sample.max_tokens=4",
                        f"checkpoint.resume={trained_run}/checkpoints/step_000030"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "runs the checkpoint's model" not in r.stderr
    assert [p.name for p in (tmp_path / "outputs").iterdir()] == [trained_run.name]
    assert "sampling " in (tmp_path / "outputs" / trained_run.name / "console.log").read_text()


@pytest.mark.parametrize("args, message", [
    (["checkpoint.resume=/nonexistent/step_000010"],
     "checkpoint error: checkpoint.resume=/nonexistent/step_000010: no such directory"),
    ([], "input error: mode=sample: no committed checkpoint in {run}/checkpoints "
         "(train this run first, or set checkpoint.resume=PATH)"),
])
def test_mode_sample_refuses_a_bad_checkpoint_before_building_anything(tmp_path, args, message):
    r = _sample(tmp_path, *args)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1] == "xtrain: " + message.format(run=tmp_path)
    assert "sampling" not in r.stdout and "tokenizer" not in r.stdout
    assert not tmp_path.exists() or not any(tmp_path.iterdir())  # no log, no record left


def test_mode_sample_says_whose_checkpoint_it_reads_and_where_newer_ones_are(trained_run, tmp_path):
    """A checkpoint.dir another run wrote to is read (the checkpoint decides the model), with a
    warning naming that run, and one naming the model settings given that it does not use; a run whose last training saved its checkpoints elsewhere is
    refused naming where, or warned of the newer ones there."""
    ckpts = trained_run / "checkpoints"
    r = _sample(tmp_path / "other", f"checkpoint.dir={ckpts}", "run.name=other", "sample.max_tokens=4",
                "model.depth=3", "model.softcap=20", "model.attention_block=8")
    assert r.returncode == 0, r.stderr[-3000:]
    assert ("xtrain: warning: mode=sample runs the checkpoint's model; the one this command gives "
            "differs and is not used: model.depth=3 (the checkpoint's: 2), model.softcap=20.0 (the "
            "checkpoint's: 15.0)\n") in r.stderr, r.stderr  # (the attention block is no model's)
    assert re.search(rf"xtrain: warning: mode=sample reads {ckpts}/step_000030, written by run "
                     rf"\S+ \(not other\)\n", r.stderr), r.stderr
    moved = tmp_path / "moved"
    (moved / ".hydra").mkdir(parents=True)  # its training's record: checkpoints saved elsewhere
    (moved / ".hydra" / "config.yaml").write_text(f"checkpoint:\n  dir: {ckpts}\n")
    r = _sample(moved)
    assert r.returncode == 2, r.stderr[-3000:]
    assert r.stderr.strip().splitlines()[-1] == (
        f"xtrain: input error: mode=sample: no committed checkpoint in {moved}/checkpoints (the "
        f"last training of this run saved its checkpoints to {ckpts}, newest {ckpts}/step_000030: "
        f"add checkpoint.dir={ckpts})")
    shutil.copytree(ckpts / "step_000020", moved / "checkpoints" / "step_000020")  # an older one here
    r = _sample(moved, "sample.max_tokens=4")
    assert r.returncode == 0, r.stderr[-3000:]
    assert (f"xtrain: warning: mode=sample reads {moved}/checkpoints/step_000020, but the last "
            f"training of this run saved newer checkpoints to {ckpts} (newest {ckpts}/step_000030): "
            f"add checkpoint.dir={ckpts} to read them") in r.stderr, r.stderr


def test_a_sample_sweep_that_finds_no_checkpoint_says_why_a_sweep_does_not(tmp_path):
    """A sweep's jobs read their own dirs, named with the sweep's mode: a sample sweep after a
    training sweep finds nothing there, and the refusal says why and what to give instead."""
    r = subprocess.run([sys.executable, "-m", "xtrain", "-m", *TINY, "mode=sample",
                        "optim.matrix_lr=0.01,0.02"], cwd=tmp_path, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 2
    line = r.stderr.strip().splitlines()[-1]
    assert line.startswith("xtrain: input error: mode=sample: no committed checkpoint in "
                           f"{tmp_path}/multirun/"), line
    assert line.endswith("/checkpoints (a sweep's job reads the checkpoints of its own dir, and a "
                         "sweep's mode and sample settings are in its dirs' names: a sweep of "
                         "this mode does not find a training sweep's checkpoints; give each job "
                         "checkpoint.resume=PATH, such as multirun/<training sweep>/<job>/"
                         "checkpoints/step_N)"), line
    assert not (tmp_path / "multirun").exists()  # no job dir kept, so no sweep record either


def test_the_model_given_is_compared_with_the_checkpoints_as_a_network(compose_config, capsys):
    """Composed without Hydra's command line, every architecture field counts as given: an
    n_kv_head equal to the head count is the checkpoint's network (which left it unset); another
    one is not, and is named."""
    from omegaconf import OmegaConf

    from xtrain.modes import say_model_not_used

    trained = OmegaConf.to_container(compose_config(["model=d2"]).model, resolve=True)
    saved = OmegaConf.create({**trained, "n_kv_head": None, "vocab_size": 512, "sequence_len": 64})
    for kv, said in ((4, ""), (2, "model.n_kv_head=2 (the checkpoint's: unset)")):
        say_model_not_used(compose_config(["model=d2", f"model.n_kv_head={kv}", "mode=sample"]), saved)
        err = capsys.readouterr().err
        assert (said in err) if said else err == "", err


def test_mode_sample_refuses_a_prompt_longer_than_the_context(trained_run):
    r = _sample(trained_run, "sample.max_tokens=200")
    assert r.returncode == 2
    assert "+ sample.max_tokens=200 exceed the model's sequence_len 64" in r.stderr
    # a prompt the context cannot hold at all: no max_tokens helps, and none is suggested
    r = _sample(trained_run, "sample.max_tokens=1", "sample.prompt='" + "int x; " * 40 + "'")
    assert r.returncode == 2
    line = r.stderr.strip().splitlines()[-1]
    assert "alone fills the model's sequence_len 64: it needs a model trained with a longer" in line
    assert "max_tokens" not in line
