"""Load and validate a C++ benchmark file (JSONL, format in xtrain/evals/__init__.py).

Local paths and fsspec URLs (``gs://bucket/cpp.jsonl``) read the same way. Every line is checked
before any model call or compile; the first bad line is a :class:`ProblemFileError` naming the
file, the line number and what is wrong.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import fsspec

from xtrain.errors import ConfigError
from xtrain.evals import stop

DEFAULT_FILE = str(Path(__file__).with_name("cpp_problems.jsonl"))
DIFFICULTIES = ("easy", "medium", "hard")
FIELDS = ("id", "difficulty", "prompt", "reference", "tests")
_ID = re.compile(r"[A-Za-z0-9_.-]+")  # ids name files and W&B keys: keep them plain
_TESTS_MAIN = re.compile(r"\bint\s+main\s*\(\s*(void\s*)?\)")


class ProblemFileError(ConfigError):
    """A benchmark file is malformed; the message names the file and line."""


@dataclass(frozen=True)
class Problem:
    id: str
    difficulty: str  # easy | medium | hard
    prompt: str  # start of the C++ file; ends inside the function body the model completes
    reference: str  # a completion of the prompt that passes the tests
    tests: str  # C++ appended after the completion; `int main()` returns 0 when all checks pass


def load_problems(path: str | None = None) -> list[Problem]:
    """Every problem in ``path`` (None: the shipped benchmark), in file order."""
    path = path or DEFAULT_FILE
    try:
        with fsspec.open(path, "rt", encoding="utf-8") as f:
            lines = f.read().split("\n")  # JSONL's only separator (a string may hold U+2028)
    except FileNotFoundError:
        raise ProblemFileError(f"C++ benchmark file {path} does not exist") from None
    except UnicodeDecodeError as e:
        raise ProblemFileError(f"C++ benchmark file {path} is not UTF-8 text ({e.reason} at byte "
                               f"{e.start}): expected JSONL, one problem per line") from None
    except OSError as e:  # a directory, a file without read permission
        raise ProblemFileError(f"C++ benchmark file {path} cannot be read "
                               f"({type(e).__name__}: {e.strerror or e})") from None
    except (ValueError, ImportError) as e:  # (fsspec: a protocol unknown, or its package missing)
        raise ProblemFileError(f"C++ benchmark file {path} cannot be read "
                               f"({type(e).__name__}: {e})") from None
    problems: list[Problem] = []
    first_line: dict[str, int] = {}
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue  # blank lines (a trailing newline, spacing) carry nothing
        try:
            problem = parse_line(line)
        except ValueError as e:
            raise ProblemFileError(f"{path}:{number}: {e}") from None
        if problem.id in first_line:
            raise ProblemFileError(f"{path}:{number}: duplicate id {problem.id!r} (first on "
                                   f"line {first_line[problem.id]})")
        first_line[problem.id] = number
        problems.append(problem)
    if not problems:
        raise ProblemFileError(f"{path}: no problems (expected one JSON object per line)")
    return problems


def parse_line(line: str) -> Problem:
    """One JSONL line as a Problem; ValueError says what is wrong with it."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"bad JSON ({e.msg}: column {e.colno})") from None
    if not isinstance(obj, dict):
        raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
    missing = [name for name in FIELDS if name not in obj]
    unknown = sorted(set(obj) - set(FIELDS))
    if missing:
        raise ValueError(f"missing field(s) {', '.join(missing)} (every line needs "
                         f"{', '.join(FIELDS)})")
    if unknown:
        raise ValueError(f"unknown field(s) {', '.join(unknown)} (allowed: {', '.join(FIELDS)})")
    for name in FIELDS:
        if not isinstance(obj[name], str) or not obj[name].strip():
            raise ValueError(f"field {name!r} must be a non-empty string")
        try:
            obj[name].encode("utf-8")  # (JSON's escapes can spell half a surrogate pair)
        except UnicodeEncodeError as e:
            raise ValueError(f"field {name!r} holds {e.object[e.start]!r} at character {e.start}, "
                             "half a surrogate pair: not text") from None
    problem = Problem(**{name: obj[name] for name in FIELDS})
    _check_problem(problem)
    return problem


def _check_problem(p: Problem) -> None:
    if not _ID.fullmatch(p.id):
        raise ValueError(f"id {p.id!r}: use letters, digits, '_', '.', '-' only")
    if p.difficulty not in DIFFICULTIES:
        raise ValueError(f"problem {p.id!r}: unknown difficulty {p.difficulty!r} (expected "
                         f"{', '.join(DIFFICULTIES)})")
    if stop.prompt_depth(p.prompt) < 1:
        raise ValueError(f"problem {p.id!r}: the prompt must end inside the function body the "
                         f"model completes (after its opening brace)")
    # The stop rule must keep the whole reference: otherwise a model writing exactly the
    # reference would be cut short, and the benchmark would score its own answer as wrong.
    if stop.cut(p.prompt, p.reference).strip() != p.reference.strip():
        raise ValueError(f"problem {p.id!r}: the reference must end with the brace that closes "
                         f"the prompt's function, and contain nothing after it")
    if not _TESTS_MAIN.search(p.tests):
        raise ValueError(f"problem {p.id!r}: tests must define `int main()` (returns 0 when "
                         f"every check passes)")
