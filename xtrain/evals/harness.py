"""Compile and test completions of C++ problems in the sandbox; score them.

:func:`evaluate` judges given completions; :func:`generate_and_evaluate` first asks a
``generate(prompts, n) -> [[raw continuation] * n] * len(prompts)`` callable (the training code
adapts the model's decoding to it: this module imports no torch), cuts each continuation with the
stop rule and then judges. Programs compile and run in parallel, one sandbox slot per worker
thread (the threads only wait on child processes).

Outcomes: compile_error, timeout (wall clock, or CPU seconds), runtime_error (a signal or an
exit code other than 0 and 1), wrong_answer (exit code 1, or exit 0 before the tests finished),
passed. Records (one JSON object per sample): id, difficulty, sample (index), code (the
completion after the stop rule), compiled, outcome, compiler_message and test_output (capped at
``eval.message_chars``), exit_code (128 + signal for a signal), compile_s, run_s (None when not
run). The tests' ``main`` is renamed and called from a harness ``main`` that prints a random
marker after it returns 0: a completion that calls ``exit(0)`` does not pass. A completion with a
preprocessor directive (``#define answer() 42`` rewrites the tests that follow) is not compiled:
a compile_error (the stop rule confines a completion to a function body, where a directive has
no use). The scores assume a model that does not deliberately game the tests; the sandbox
protects the machine, not the score.
"""

from __future__ import annotations

import json
import os
import posixpath
import re
import secrets
import shutil
import signal
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import fsspec

from xtrain.errors import ConfigError
from xtrain.evals import stop
from xtrain.evals.config import EvalConfig, check
from xtrain.evals.problems import DIFFICULTIES, Problem, load_problems
from xtrain.evals.sandbox import (BARE_PROGRAM, Result, Sandbox, Session, limits_for,
                                  toolchain_prefix)

OUTCOMES = ("compile_error", "timeout", "runtime_error", "wrong_answer", "passed")
Generate = Callable[[list[str], int], list[list[str]]]

_FOOTER = """
#undef main
#include <cstdio>
static volatile unsigned char xtrain_key[] = {{{key}}};  // volatile: never folded into the text
static const unsigned char xtrain_masked[] = {{{masked}}};
int main() {{
  int rc = xtrain_tests_main();
  if (rc == 0) {{
    std::putchar('\\n');
    for (unsigned i = 0; i < sizeof xtrain_masked; ++i) std::putchar(xtrain_masked[i] ^ xtrain_key[i]);
    std::putchar('\\n');
  }}
  return rc;
}}
"""


def program(problem: Problem, completion: str, marker: str) -> str:
    """The file compiled for one sample: prompt, completion, tests (their ``main`` renamed),
    then a ``main`` that prints ``marker`` once the tests return 0. The marker is built as it is
    printed, from two random byte arrays (a nonzero mask: no byte of it stands where it is
    printed): a completion searching its own binary (/proc/self/exe) for the marker's text finds
    nothing. One that decodes the footer's arrays could still forge it: nothing in one process
    keeps a secret from code running in it, which is why the scores assume no deliberate gaming."""
    key = [secrets.randbelow(255) + 1 for _ in marker]
    masked = [b ^ k for b, k in zip(marker.encode(), key)]
    return (problem.prompt + completion + "\n#define main xtrain_tests_main\n" + problem.tests
            + _FOOTER.format(key=",".join(map(str, key)), masked=",".join(map(str, masked))))


_DIRECTIVE = re.compile(r"#|%:|\?\?=")  # '#', its digraph and its trigraph


def directive(completion: str) -> str | None:
    """The first line of ``completion`` that may be a preprocessor directive, or None: a '#' (or
    '%:', '??=') after only blanks on its line, or after a comment's end (the line may begin in
    a comment, which counts as blank before a directive). Lines joined by a backslash count as
    one, as the compiler joins them, and NUL characters are dropped, as the compiler ignores
    them. Cautious: a '#' in a string there counts too, one sample scored a compile error for
    nothing, where missing a directive would let it rewrite the tests."""
    for line in re.sub(r"\\[ \t\r]*\n", "", completion.replace("\0", "")).splitlines():
        for found in _DIRECTIVE.finditer(line):  # every one: the first may be in a comment
            if not line[:found.start()].strip() or "*/" in line[:found.start()]:
                return line.strip()
    return None


def prepare(cfg: EvalConfig) -> list[Problem]:
    """Check everything an evaluation needs before training starts (the config, the benchmark
    file, the compiler inside the sandbox, and that each reference of a file other than the
    shipped one passes its tests) and return the problems."""
    check(cfg)
    problems = load_problems(cfg.cpp_file)
    if cfg.cpp_file:  # (the shipped references are judged by tests/test_evals_problems.py)
        _check_references(problems, cfg)  # (the toolchain first)
        return problems
    gxx = find_gxx(cfg)
    sandbox = Sandbox(cfg, 1)
    try:
        _check_toolchain(sandbox, gxx, cfg)
    finally:
        sandbox.close()
    return problems


def _check_references(problems: Sequence[Problem], cfg: EvalConfig) -> None:
    """Judge each problem's reference once: one that fails its own tests (a tests ``main``
    falling off its end, a typo) would fail every sample, and score 0 for every model unnoticed."""
    records = judge_all(problems, {p.id: [p.reference] for p in problems}, cfg)
    failed = [r for r in records if r["outcome"] != "passed"]
    if failed:
        first = failed[0]
        said = (first["test_output"] if first["compiled"] else
                "\n".join(ln for ln in first["compiler_message"].splitlines() if "error" in ln))
        exit_code = "" if first["exit_code"] is None else f", exit code {first['exit_code']}"
        raise ConfigError(
            f"eval.cpp_file={cfg.cpp_file}: the reference of {len(failed)} problem(s) does not "
            f"pass its own tests, so no sample could ({', '.join(r['id'] for r in failed[:5])}); "
            f"{first['id']!r}: {first['outcome']}{exit_code}"
            + (f": {said.strip().splitlines()[0][:200]}" if said.strip() else ""))


def generate_and_evaluate(generate: Generate, problems: Sequence[Problem], cfg: EvalConfig,
                          records_path: str | None = None,
                          cancel: threading.Event | None = None) -> tuple[dict, list[dict]]:
    """Sample ``cfg.n`` continuations per prompt, cut them with the stop rule, judge them
    (``cancel``: see :func:`evaluate`)."""
    check(cfg)
    start = time.perf_counter()
    raw = generate([p.prompt for p in problems], cfg.n)
    if len(raw) != len(problems) or any(len(r) != cfg.n for r in raw):
        raise ValueError(f"generate returned {[len(r) for r in raw]} continuations for "
                         f"{len(problems)} prompts; expected {cfg.n} per prompt")
    generate_s = time.perf_counter() - start
    completions = {p.id: [stop.cut(p.prompt, text, cfg.eof_markers) for text in texts]
                   for p, texts in zip(problems, raw)}
    scores, records = evaluate(problems, completions, cfg, records_path, cancel)
    scores["cpp_generate_seconds"] = generate_s
    return scores, records


def evaluate(problems: Sequence[Problem], completions: Mapping[str, Sequence[str]],
             cfg: EvalConfig, records_path: str | None = None,
             cancel: threading.Event | None = None) -> tuple[dict, list[dict]]:
    """Compile and test every completion (already cut); return the scores and one record per
    sample, also written as JSONL to ``records_path`` (any fsspec URL) when given. ``cancel``
    set (the run is stopping) raises xtrain.evals.sandbox.Cancelled within a tenth of a
    second: the samples not judged yet are skipped, the running compiles and programs killed."""
    check(cfg)
    missing = [p.id for p in problems if not completions.get(p.id)]
    if missing:
        raise ValueError(f"no completions for problem(s) {', '.join(missing[:5])}")
    few = [p.id for p in problems if len(completions[p.id]) < max(cfg.k)]
    if few:
        raise ValueError(f"fewer than {max(cfg.k)} completions (eval.k={list(cfg.k)}) for "
                         f"problem(s) {', '.join(few[:5])}: pass@k needs at least k samples")
    start = time.perf_counter()
    records = judge_all(problems, completions, cfg, cancel)
    scores = score(records, cfg.k)
    scores["cpp_eval_seconds"] = time.perf_counter() - start
    if records_path:
        write_records(records, records_path)
    return scores, records


def judge_all(problems: Sequence[Problem], completions: Mapping[str, Sequence[str]],
              cfg: EvalConfig, cancel: threading.Event | None = None) -> list[dict]:
    """One record per completion, judged in parallel (``cancel``: see :func:`evaluate`)."""
    gxx = find_gxx(cfg)
    jobs = [(p, i, c) for p in problems for i, c in enumerate(completions[p.id])]
    workers = min(cfg.workers or len(os.sched_getaffinity(0)), len(jobs))
    # random, so no completion can print it by heart; a program could still forge it from the
    # pieces its own binary holds (program()): in-process code cannot be kept from a secret
    marker = f"xtrain-tests-passed-{secrets.token_hex(8)}"
    sandbox = Sandbox(cfg, workers, cancel)
    try:
        _check_toolchain(sandbox, gxx, cfg)
        with ThreadPoolExecutor(workers, thread_name_prefix="cpp-eval") as pool:
            return list(pool.map(lambda job: _judge(sandbox, gxx, cfg, marker, *job), jobs))
    finally:
        sandbox.close()


def find_gxx(cfg: EvalConfig) -> str:
    """The compiler's path; refused (a config error) when it is not on PATH, or installed in a
    directory the sandbox must not show the programs: one holding home directories (keys in
    ~/.netrc, ~/.config/gcloud) or the working dir (code, runs), or one inside the home
    directory (``~/.local``: pip's user installs, keyrings under ~/.local/share)."""
    gxx = shutil.which(cfg.gxx)
    if gxx is None:
        raise ConfigError(f"eval.gxx={cfg.gxx!r}: compiler not found on PATH")
    prefix = toolchain_prefix(gxx)
    private = {"the home directory": Path.home(), "/root": Path("/root"), "/home": Path("/home"),
               "the working dir": Path.cwd()}
    for what, path in private.items():
        holds = prefix and (path == prefix or prefix in path.parents)
        inside = prefix and what == "the home directory" and path != Path("/") and path in prefix.parents
        if holds or inside:
            raise ConfigError(
                f"eval.gxx={gxx}: installed under {prefix}, {'which holds' if holds else 'inside'} "
                f"{what} ({path}); the sandbox shows a compiler's install prefix to the generated "
                "programs (read-only): install it under a prefix of its own (such as /opt/gcc-13) "
                "or in /usr")
    return gxx


def _compile(session: Session, gxx: str, cfg: EvalConfig) -> Result:
    # -fmax-errors bounds the message a broken completion produces (template errors run long).
    argv = [gxx, f"-std={cfg.std}", *cfg.flags, "-fmax-errors=10", "-o", "prog", "main.cpp"]
    return session.run(argv, limits_for(cfg, compile=True))


def _check_toolchain(sandbox: Sandbox, gxx: str, cfg: EvalConfig) -> None:
    """Start a bare program in the sandbox, then compile and run an empty one, so that a sandbox
    that cannot start programs under the eval's limits, or a bad compiler, flag or standard, is
    one clear error naming its cause instead of every sample scored as a compile error."""
    with sandbox.session() as session:
        bare = session.run([BARE_PROGRAM], limits_for(cfg, compile=False))
        if bare.returncode != 0:
            said = (bare.stderr.strip().splitlines() or [f"exit {bare.returncode}"])[-1]
            raise ConfigError(
                f"eval.sandbox={getattr(cfg.sandbox, 'value', cfg.sandbox)}: {BARE_PROGRAM} does "
                f"not start in the sandbox ({sandbox.mode}) under the eval's limits "
                f"(run_memory_mb={cfg.run_memory_mb}, max_processes={cfg.max_processes}, "
                f"max_open_files={cfg.max_open_files}): {said}")
        session.write("main.cpp", "int main() { return 0; }\n")
        built = _compile(session, gxx, cfg)
        ran = session.run(["./prog"], limits_for(cfg, compile=False)) if built.returncode == 0 \
            else None
    if built.returncode != 0 or ran is None or ran.returncode != 0:
        message = (built.stderr or (ran.stderr if ran else "")).strip().splitlines()[:1]
        raise ConfigError(f"eval.gxx/std/flags: an empty C++ program does not compile and run "
                          f"in the sandbox ({sandbox.mode}): {message or built.returncode}")


def _judge(sandbox: Sandbox, gxx: str, cfg: EvalConfig, marker: str, problem: Problem,
           sample: int, completion: str) -> dict:
    record = {"id": problem.id, "difficulty": problem.difficulty, "sample": sample,
              "code": completion, "compiled": False, "outcome": "compile_error",
              "compiler_message": "", "test_output": "", "exit_code": None, "compile_s": None,
              "run_s": None}
    found = directive(completion)
    if found is not None:
        record["compiler_message"] = (f"not compiled: a preprocessor directive in the completion "
                                      f"({found!r}) could rewrite the tests")[:cfg.message_chars]
        return record
    with sandbox.session() as session:
        session.write("main.cpp", program(problem, completion, marker))
        built = _compile(session, gxx, cfg)
        record["compile_s"] = round(built.seconds, 3)
        message = built.stderr + (f"\ncompile timed out after {cfg.compile_timeout_s:g} s"
                                  if built.timed_out else "")
        if built.returncode != 0 and not message.strip():
            message = silent_failure(built.returncode)
        record["compiler_message"] = message.strip()[:cfg.message_chars]
        if built.returncode != 0 or built.timed_out:
            return record
        record["compiled"] = True
        ran = session.run(["./prog"], limits_for(cfg, compile=False))
    record["run_s"] = round(ran.seconds, 3)
    record["exit_code"] = ran.returncode
    record["outcome"] = outcome(ran, marker)
    output = ran.stdout.replace(marker, "").strip() + "\n" + ran.stderr.strip()
    record["test_output"] = output.strip()[:cfg.message_chars]
    return record


def silent_failure(code: int) -> str:
    """A failed compile's message when the compiler said nothing: how it ended (a signal, as
    Result gives it: 128 + its number), so that no compile_error is recorded without a cause (one
    with an empty message came up once in the test suite, among thousands of compiles)."""
    ended = f"exit {code}"
    if code > 128 and code - 128 in signal.valid_signals():
        ended = signal.Signals(code - 128).name
    return f"the compiler failed without a message ({ended})"


def outcome(ran: Result, marker: str) -> str:
    """What a test run's exit says (compile errors are decided before a run)."""
    if ran.timed_out or ran.returncode == 128 + signal.SIGXCPU:
        return "timeout"
    if ran.returncode == 0 and ran.stdout.rstrip().endswith(marker):
        return "passed"
    if ran.returncode in (0, 1):  # a failed check, or an exit before the tests finished
        return "wrong_answer"
    return "runtime_error"


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from ``n`` samples of which ``c`` passed (Chen et al. 2021, "Evaluating
    Large Language Models Trained on Code"): 1 - C(n-c, k) / C(n, k), as a stable product."""
    if not 0 <= c <= n or k > n:
        raise ValueError(f"pass@{k} from {n} samples, {c} passed: needs 0 <= c <= n and k <= n")
    if n - c < k:
        return 1.0
    product = 1.0
    for i in range(n - c + 1, n + 1):
        product *= 1.0 - k / i
    return 1.0 - product


def score(records: Sequence[dict], ks: Sequence[int]) -> dict[str, float]:
    """cpp_compile_rate, cpp_pass_rate (fractions of samples) and cpp_pass@k (mean over
    problems), overall and per difficulty (``cpp_pass_rate/easy``, ...)."""
    groups: dict[str, list[dict]] = defaultdict(list)
    for r in records:
        groups[""].append(r)
        groups["/" + r["difficulty"]].append(r)
    scores: dict[str, float] = {}
    for suffix in ["", *(f"/{d}" for d in DIFFICULTIES)]:
        group = groups.get(suffix)
        if not group:
            continue
        scores["cpp_compile_rate" + suffix] = sum(r["compiled"] for r in group) / len(group)
        scores["cpp_pass_rate" + suffix] = sum(r["outcome"] == "passed" for r in group) / len(group)
        by_problem: dict[str, list[bool]] = defaultdict(list)
        for r in group:
            by_problem[r["id"]].append(r["outcome"] == "passed")
        for k in ks:
            estimates = [pass_at_k(len(p), sum(p), k) for p in by_problem.values()]
            scores[f"cpp_pass@{k}" + suffix] = sum(estimates) / len(estimates)
    return scores


def write_records(records: Sequence[dict], path: str) -> None:
    """One JSON object per sample, to a local path or any fsspec URL (parents created)."""
    fs, target = fsspec.core.url_to_fs(path)
    fs.makedirs(posixpath.dirname(target), exist_ok=True)
    with fs.open(target, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
