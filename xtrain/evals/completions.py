"""Completions of the benchmark's prompts from a GPT: the model side of
:func:`xtrain.evals.harness.generate_and_evaluate`, kept apart so the harness imports no torch.

KV-cache generation (:func:`xtrain.model.generate.generate`) on the model's device (the training
callback hands it a CPU copy), ``eval.n`` samples per prompt, greedy at ``eval.temperature=0``;
a prompt's rows stop as soon as the stop rule finds the end of its function, so a completion costs
the tokens of one function, not ``eval.max_tokens``.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Sequence

from xtrain.config import EvalConfig
from xtrain.evals import stop
from xtrain.evals.harness import Generate, generate_and_evaluate
from xtrain.evals.problems import Problem
from xtrain.evals.sandbox import Cancelled
from xtrain.model.generate import check_prompts_fit, generate, prompt_ids

SEED = 0  # the same seed at every evaluation: scores of one run differ only by what it learnt
# eval.max_tokens unset: a completion's budget, cut to what the model's context leaves (an untrained
# model may never close the function: the budget bounds an evaluation's time)
DEFAULT_MAX_TOKENS = 384


def check_fit(tokenizer, problems: Sequence[Problem], cfg: EvalConfig, sequence_len: int) -> None:
    """Refuse, before any generation, a prompt that leaves no room for ``eval.max_tokens`` (or,
    when None, for one token)."""
    check_prompts_fit(tokenizer, [p.prompt for p in problems], cfg.max_tokens, sequence_len,
                      "eval.max_tokens")


def model_generate(model, tokenizer, cfg: EvalConfig, stats: dict | None = None,
                   cancel=None) -> Generate:
    """A ``generate(prompts, n)`` for the harness; ``stats`` (when given) receives the
    ``tokens`` generated and the ``seconds`` spent. ``cancel`` (a threading.Event) set raises
    :class:`Cancelled` at the next token."""

    def ended(prompt: str, text: str) -> bool:
        if cancel is not None and cancel.is_set():
            raise Cancelled("the run is stopping")
        return stop.ended(prompt, text, cfg.eof_markers)

    def run(prompts: list[str], n: int) -> list[list[str]]:
        texts, tokens, seconds = [], 0, 0.0
        for i, prompt in enumerate(prompts):
            one: dict = {}
            room = model.config.sequence_len - len(prompt_ids(tokenizer, prompt))
            max_tokens = cfg.max_tokens or min(DEFAULT_MAX_TOKENS, room)
            texts += generate(model, tokenizer, [prompt], n, max_tokens=max_tokens,
                              temperature=cfg.temperature, top_k=cfg.top_k, seed=SEED + i,
                              stop=lambda text, p=prompt: ended(p, text), stats=one)
            tokens, seconds = tokens + one["tokens"], seconds + one["seconds"]
        if stats is not None:
            stats.update(tokens=tokens, seconds=seconds)
        return texts

    return run


def evaluate_model(model, tokenizer, problems: Sequence[Problem], cfg: EvalConfig,
                   records_path: str | None = None, cancel=None) -> dict:
    """Generate, cut, compile and test; the scores with the generation's tokens/s. Records go
    to ``records_path`` (any fsspec URL) when given. ``cancel`` (a threading.Event) set calls
    the evaluation off, generating or judging: :class:`Cancelled` is raised."""
    stats: dict = {}
    scores, _ = generate_and_evaluate(model_generate(model, tokenizer, cfg, stats, cancel), problems,
                                      cfg, records_path, cancel)
    scores["cpp_generate_tok_per_s"] = round(stats["tokens"] / max(stats["seconds"], 1e-9), 1)
    return scores


def records_path(run_dir: str, step: int, later: bool = False) -> str:
    """Where an evaluation of the weights at ``step`` writes its per-sample records: training's
    own at ``step_N.jsonl`` (its eval record in metrics.jsonl scores them), a later one
    (``mode=eval``) beside it, named by its time and a random part: never over training's, nor
    over another's started in the same second."""
    tag = f"-eval-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(3)}" if later else ""
    return f"{run_dir.rstrip('/')}/cpp_eval/step_{step:06d}{tag}.jsonl"
