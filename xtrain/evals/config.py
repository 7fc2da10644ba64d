"""Checks of the ``eval`` config (its schema, every field documented, is
:class:`xtrain.config.EvalConfig`) that ranges alone cannot express, before any model call or
compile; each refusal is one line naming the field."""

from __future__ import annotations

import re

from xtrain.config import EvalConfig, Sandbox
from xtrain.limits import out_of_range
from xtrain.errors import ConfigError

# g++ spellings of C++17 and newer (the benchmark's references use C++17 library features).
_STD = re.compile(r"(c|gnu)\+\+(17|1z|20|2a|23|2b|26|2c)")


def check(cfg: EvalConfig) -> None:
    """Refuse a config the evaluation cannot honour (one line, naming the field)."""
    problems = out_of_range(cfg, EvalConfig, "eval.")
    if problems:
        raise ConfigError("; ".join(problems))
    bad_k = [k for k in cfg.k if not 1 <= k <= cfg.n]
    if bad_k or not cfg.k:
        raise ConfigError(f"eval.k={list(cfg.k)}: each k must be in 1..eval.n={cfg.n} "
                          f"(pass@k is estimated from n samples)")
    if cfg.temperature == 0 and cfg.n > 1:
        raise ConfigError(f"eval.n={cfg.n} with eval.temperature=0: greedy decoding gives n "
                          f"identical samples; set eval.temperature > 0 or eval.n=1")
    if not _STD.fullmatch(cfg.std):
        raise ConfigError(f"eval.std={cfg.std!r}: expected c++17 or newer (c++17, c++20, "
                          f"c++23, gnu++17, ...)")
    # (g++ takes the last one; -ansi is -std=c++98 in C++)
    if std := [f for f in cfg.flags if re.match(r"--?(std\b|ansi$)", f)]:
        raise ConfigError(f"eval.flags: {std[0]} would replace eval.std={cfg.std}; set the "
                          "standard with eval.std")
    if blank := [m for m in cfg.eof_markers if not m.strip()]:
        raise ConfigError(f"eval.eof_markers: {blank[0]!r} would end every completion at once, or "
                          "at its first blank; give markers of visible text")
    if cfg.sandbox not in {s.value for s in Sandbox}:
        raise ConfigError(f"eval.sandbox={cfg.sandbox!r}: expected one of "
                          f"{', '.join(s.value for s in Sandbox)}")


__all__ = ["EvalConfig", "check"]
