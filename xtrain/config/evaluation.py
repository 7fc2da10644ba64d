"""Schema of the C++ evaluation (the ``eval`` config: xtrain/evals/). Re-exported by
:mod:`xtrain.config`."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from xtrain.limits import limits

# Upper bounds of the sandbox's limits: the resource limits they become must be numbers prlimit
# takes (a finite count of seconds or bytes); far above any sensible value
DAY_S = 86400.0
MAX_MB = 2**30  # a PiB


class Sandbox(str, Enum):
    """How the C++ evaluation isolates each program (xtrain/evals/sandbox.py)."""

    # bubblewrap when it works here; else, as root, resource limits under a private uid (with a
    # warning); without root, refused (the programs would run as this user)
    auto = "auto"
    bwrap = "bwrap"  # require bubblewrap (namespaces: no network, read-only system, private /tmp)
    rlimits = "rlimits"  # resource limits only, for machines without user namespaces


@dataclass
class EvalConfig:
    """How a model is judged on C++ problems (xtrain/evals/): sampling, the sandbox's limits, the
    compiler."""

    # Benchmark file, JSONL (format in xtrain/evals/__init__.py); a local path or any fsspec URL
    # (gs://...). None: the benchmark shipped in the package (xtrain/evals/cpp_problems.jsonl).
    cpp_file: str | None = None
    # evaluate every this many optimizer steps during training (rank 0); 0: never mid-run
    cpp_every: int = limits(0, ge=0)
    n: int = limits(1, ge=1)  # completions sampled per problem (pass@k needs n >= k)
    k: list[int] = field(default_factory=lambda: [1])  # pass@k reported for each of these k
    # 0: greedy decoding (then n must be 1: greedy samples are identical)
    temperature: float = limits(0.0, ge=0)
    top_k: int | None = limits(None, ge=1)  # sample among the top_k most likely tokens; None: all
    # new tokens per completion before the stop rule cuts it; None: 384, or what the model's
    # context leaves after the prompt where that is less (a set value must fit: refused otherwise)
    max_tokens: int | None = limits(None, ge=1)
    # Raw text that ends a completion (the tokenizer's document separator as decoded text).
    eof_markers: list[str] = field(default_factory=lambda: ["<|bos|>", "<|endoftext|>"])
    gxx: str = "g++"  # compiler executable (name on PATH or absolute path)
    std: str = "c++17"  # -std= value; C++17 or newer
    flags: list[str] = field(default_factory=lambda: ["-O1", "-pipe"])  # extra g++ flags
    compile_timeout_s: float = limits(30.0, gt=0, le=DAY_S)  # wall-clock limit of one compile
    # wall-clock limit of one test run (CPU time gets the same + 1 s)
    run_timeout_s: float = limits(5.0, gt=0, le=DAY_S)
    compile_memory_mb: int = limits(2048, ge=1, le=MAX_MB)  # address-space limit of the compiler processes
    run_memory_mb: int = limits(512, ge=1, le=MAX_MB)  # address-space limit of the test program
    # largest file a program (or the compiler, x64) may write; caps output
    max_file_kb: int = limits(1024, ge=1, le=MAX_MB * 1024)
    max_processes: int = limits(32, ge=1, le=2**22)  # processes the sandbox's user may have (fork bombs)
    max_open_files: int = limits(64, ge=1, le=2**20)  # open file descriptors per process
    workers: int = limits(0, ge=0)  # compiles/runs at once; 0: one per CPU core this process may use
    sandbox: Sandbox = Sandbox.auto
    message_chars: int = limits(2000, ge=1)  # compiler message and test output kept per record
