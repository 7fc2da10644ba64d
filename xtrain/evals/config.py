"""The ``eval`` config group's schema: the C++ compile-and-test evaluation.

Lives here until it is registered with the other groups in :mod:`xtrain.config`. Every field is
documented once, beside it. :func:`check` refuses a bad combination with a one-line error naming
the field, before any model call or compile.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from xtrain.config import ConfigError

# g++ spellings of C++17 and newer (the benchmark's references use C++17 library features).
_STD = re.compile(r"(c|gnu)\+\+(17|1z|20|2a|23|2b|26|2c)")
SANDBOXES = ("auto", "bwrap", "rlimits")


@dataclass
class EvalConfig:
    """How a model is judged on C++ problems: sampling, the sandbox's limits, the compiler."""

    # Benchmark file, JSONL (format in xtrain/evals/__init__.py); a local path or any fsspec URL
    # (gs://...). None: the benchmark shipped in the package (xtrain/evals/cpp_problems.jsonl).
    cpp_file: str | None = None
    every: int = 0  # evaluate every this many optimizer steps during training; 0: never mid-run
    n: int = 1  # completions sampled per problem (pass@k needs n >= k)
    k: list[int] = field(default_factory=lambda: [1])  # pass@k reported for each of these k
    temperature: float = 0.0  # 0: greedy decoding (then n must be 1: greedy samples are identical)
    top_k: int | None = None  # sample among the top_k most likely tokens; None: all tokens
    max_tokens: int = 384  # new tokens per completion before the stop rule cuts it
    # Raw text that ends a completion (the tokenizer's document separator as decoded text).
    eof_markers: list[str] = field(default_factory=lambda: ["<|bos|>", "<|endoftext|>"])
    gxx: str = "g++"  # compiler executable (name on PATH or absolute path)
    std: str = "c++17"  # -std= value; C++17 or newer
    flags: list[str] = field(default_factory=lambda: ["-O1", "-pipe"])  # extra g++ flags
    compile_timeout_s: float = 30.0  # wall-clock limit of one compile
    run_timeout_s: float = 5.0  # wall-clock limit of one test run (CPU time gets the same + 1 s)
    compile_memory_mb: int = 2048  # address-space limit of the compiler processes
    run_memory_mb: int = 512  # address-space limit of the test program
    max_file_kb: int = 1024  # largest file a program (or the compiler, x64) may write; caps output
    max_processes: int = 32  # processes the sandbox's user may have at once (fork-bomb guard)
    max_open_files: int = 64  # open file descriptors per process
    workers: int = 0  # compiles/runs at once; 0: one per CPU core this process may use
    # auto: bubblewrap when installed, else resource limits only (with a warning naming what is
    # missing); bwrap: require bubblewrap; rlimits: resource limits only (for machines without
    # namespaces). See xtrain/evals/sandbox.py.
    sandbox: str = "auto"
    message_chars: int = 2000  # compiler message and test output kept per record (characters)


def check(cfg: EvalConfig) -> None:
    """Refuse a config the evaluation cannot honour (one line, naming the field)."""
    if cfg.n < 1:
        raise ConfigError(f"eval.n={cfg.n}: at least one completion per problem")
    bad_k = [k for k in cfg.k if not 1 <= k <= cfg.n]
    if bad_k or not cfg.k:
        raise ConfigError(f"eval.k={list(cfg.k)}: each k must be in 1..eval.n={cfg.n} "
                          f"(pass@k is estimated from n samples)")
    if cfg.temperature < 0:
        raise ConfigError(f"eval.temperature={cfg.temperature}: must be >= 0")
    if cfg.temperature == 0 and cfg.n > 1:
        raise ConfigError(f"eval.n={cfg.n} with eval.temperature=0: greedy decoding gives n "
                          f"identical samples; set eval.temperature > 0 or eval.n=1")
    if not _STD.fullmatch(cfg.std):
        raise ConfigError(f"eval.std={cfg.std!r}: expected c++17 or newer (c++17, c++20, "
                          f"c++23, gnu++17, ...)")
    if cfg.sandbox not in SANDBOXES:
        raise ConfigError(f"eval.sandbox={cfg.sandbox!r}: expected one of {', '.join(SANDBOXES)}")
    positive = ("every", "max_tokens", "compile_timeout_s", "run_timeout_s", "compile_memory_mb",
                "run_memory_mb", "max_file_kb", "max_processes", "max_open_files", "workers",
                "message_chars")
    for name in positive:
        value = getattr(cfg, name)
        if value < 0 or (value == 0 and name not in ("every", "workers")):
            raise ConfigError(f"eval.{name}={value}: must be > 0"
                              + (" (or 0)" if name in ("every", "workers") else ""))
