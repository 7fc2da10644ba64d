"""Wall time of the whole shipped C++ benchmark judged by the sandboxed harness (the reference
solutions, one sample each), vs the same compiles and runs done bare (g++ and the program as
plain child processes, same parallelism, no sandbox): the ratio is the sandbox's overhead."""

from __future__ import annotations

import os
import statistics
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tests.bench.targets import target

COMMAND = "make bench ARGS=cpp_eval   (python -m tests.bench cpp_eval)"
ROUNDS = 3
WALL_TARGET_S = 60


def _bare(problems, cfg, workers: int) -> float:
    """Compile and run every reference without any isolation; seconds for all of them."""
    from xtrain.evals.harness import program

    def one(problem):
        with tempfile.TemporaryDirectory() as work:
            Path(work, "main.cpp").write_text(program(problem, problem.reference, "done"))
            subprocess.run([cfg.gxx, f"-std={cfg.std}", *cfg.flags, "-o", "prog", "main.cpp"],
                           cwd=work, check=True, capture_output=True)
            subprocess.run(["./prog"], cwd=work, check=True, capture_output=True)

    start = time.perf_counter()
    with ThreadPoolExecutor(workers) as pool:
        list(pool.map(one, problems))
    return time.perf_counter() - start


def run() -> str:
    from xtrain.evals import EvalConfig, evaluate, load_problems
    from xtrain.evals.sandbox import Sandbox

    problems = load_problems()
    cfg = EvalConfig()
    cores = len(os.sched_getaffinity(0))
    mode = Sandbox(cfg, 1)
    mode.close()
    walls, bares, records = [], [], []
    for _ in range(ROUNDS):  # alternate sandboxed and bare; noise only slows, keep the median
        scores, records = evaluate(problems, {p.id: [p.reference] for p in problems}, cfg)
        assert scores["cpp_pass_rate"] == 1.0, scores
        walls.append(scores["cpp_eval_seconds"])
        bares.append(_bare(problems, cfg, cores))
    wall, bare = statistics.median(walls), statistics.median(bares)
    compile_s = sum(r["compile_s"] for r in records)
    run_s = sum(r["run_s"] for r in records)
    slowest = max(records, key=lambda r: r["compile_s"] + r["run_s"])
    return (f"## C++ compile-and-test evaluation (whole benchmark, reference solutions)\n\n"
            f"`{COMMAND}`: {len(problems)} problems, one sample each, `-std={cfg.std} "
            f"{' '.join(cfg.flags)}`, {cores} cores, {cores} workers, sandbox `{mode.mode}`.\n\n"
            f"| path | wall s (median of {ROUNDS}) |\n| --- | --- |\n"
            f"| bare g++ + run, no isolation (baseline) | {bare:.1f} |\n"
            f"| `xtrain.evals.evaluate` (sandboxed, all guards) | {wall:.1f} |\n\n"
            f"**ratio sandboxed / bare = {wall / bare:.2f}**; target: the whole benchmark under "
            f"{WALL_TARGET_S} s on 2 cores, "
            f"{target(wall < WALL_TARGET_S, 'cpp_eval: whole benchmark wall time')} "
            f"({wall:.1f} s). Inside one "
            f"sandboxed round: compiles {compile_s:.1f} s and runs {run_s:.1f} s summed over "
            f"samples; slowest problem `{slowest['id']}` ({slowest['compile_s']:.2f} s compile, "
            f"{slowest['run_s']:.2f} s run).\n")
