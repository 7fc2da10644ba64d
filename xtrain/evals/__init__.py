"""Evaluations run during and after training: the C++ compile-and-test benchmark.

A C++ benchmark is a JSONL file, one problem per line (blank lines ignored), each an object with
exactly these string fields:

- ``id``: unique in the file; letters, digits, ``_ . -`` (used in records and metric names).
- ``difficulty``: ``easy``, ``medium`` or ``hard`` (scores are also reported per difficulty).
- ``prompt``: the start of a C++ file the model continues: includes, a comment stating the task,
  any helper types, then the function's signature and its opening brace. It must end inside
  that function's body.
- ``reference``: a completion of ``prompt`` that passes: the function's body through the brace
  that closes it, nothing after it (the stop rule in :mod:`xtrain.evals.stop` must keep all of it).
- ``tests``: hidden C++ appended after the completion, defining ``int main()`` that returns 0
  when every check passes and 1 at the first failed check (print what failed: it is kept in the
  records). ``main`` must return explicitly (it is renamed and called by the harness).

Example line (wrapped here)::

  {"id": "add", "difficulty": "easy",
   "prompt": "// Return a + b.\\nint add(int a, int b) {\\n",
   "reference": "  return a + b;\\n}\\n",
   "tests": "int main() {\\n  if (add(2, 3) != 5) return 1;\\n  return 0;\\n}\\n"}

The shipped benchmark is ``cpp_problems.jsonl`` beside this file; ``eval.cpp_file`` names another
file of the same format (a local path or ``gs://...``). Modules: ``config`` (checks of the ``eval``
section beyond its schema, xtrain/config/evaluation.py), ``problems`` (load and validate),
``stop`` (cut a continuation at the function's end), ``sandbox`` (isolated compile and run),
``uids`` (the sandbox's private uids when run as root),
``harness`` (parallel judging, scores, records), ``completions`` (the model's samples).
"""

from xtrain.evals.config import EvalConfig
from xtrain.evals.harness import (evaluate, generate_and_evaluate, pass_at_k, prepare,
                                  write_records)
from xtrain.evals.problems import Problem, ProblemFileError, load_problems

__all__ = ["EvalConfig", "Problem", "ProblemFileError", "evaluate", "generate_and_evaluate",
           "load_problems", "pass_at_k", "prepare", "write_records"]
