"""Scores (pass@k by hand), the eval config's checks, records on GCS and the generation
interface the training loop plugs into."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import fsspec
import pytest

from xtrain.errors import ConfigError
from xtrain.evals import (EvalConfig, ProblemFileError, evaluate, generate_and_evaluate,
                          pass_at_k, prepare, write_records)
from xtrain.evals.config import check
from xtrain.evals.harness import score
from xtrain.evals.problems import Problem

ADD = Problem(id="add", difficulty="easy", prompt="// Return a + b.\nint add(int a, int b) {\n",
              reference="  return a + b;\n}\n",
              tests="#include <cstdio>\nint main() {\n  if (add(2, 3) != 5) {\n"
                    "    std::puts(\"add(2, 3) != 5\");\n    return 1;\n  }\n  return 0;\n}\n")
NEG = Problem(id="neg", difficulty="hard", prompt="int neg(int a) {\n",
              reference="  return -a;\n}\n", tests="int main() { return neg(4) == -4 ? 0 : 1; }\n")


@pytest.mark.parametrize("n, c, k, expected", [
    (5, 2, 1, 0.4),
    (5, 2, 2, 1 - 3 / 10),  # 1 - C(3,2)/C(5,2)
    (5, 2, 3, 1 - 1 / 10),  # 1 - C(3,3)/C(5,3)
    (5, 2, 4, 1.0),  # fewer than k failures: some k-subset always passes
    (10, 0, 5, 0.0),
    (10, 3, 3, 1 - 35 / 120),  # 1 - C(7,3)/C(10,3)
    (1, 1, 1, 1.0),
])
def test_pass_at_k_matches_hand_computed_values(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected)


def record(pid, difficulty, outcome):
    return {"id": pid, "difficulty": difficulty, "outcome": outcome,
            "compiled": outcome != "compile_error"}


def test_scores_overall_and_per_difficulty():
    records = [record("a", "easy", "passed"), record("a", "easy", "wrong_answer"),
               record("a", "easy", "compile_error")] + [record("b", "hard", "compile_error")] * 3
    scores = score(records, [1, 2])
    assert scores == pytest.approx({
        "cpp_compile_rate": 2 / 6, "cpp_pass_rate": 1 / 6,
        "cpp_pass@1": (1 / 3 + 0) / 2, "cpp_pass@2": (2 / 3 + 0) / 2,  # a: 1 - C(2,2)/C(3,2)
        "cpp_compile_rate/easy": 2 / 3, "cpp_pass_rate/easy": 1 / 3,
        "cpp_pass@1/easy": 1 / 3, "cpp_pass@2/easy": 2 / 3,
        "cpp_compile_rate/hard": 0.0, "cpp_pass_rate/hard": 0.0,
        "cpp_pass@1/hard": 0.0, "cpp_pass@2/hard": 0.0,
    })  # no medium problem: no medium keys


@pytest.mark.parametrize("changes, message", [
    ({"n": 2, "k": [1, 3], "temperature": 0.8}, r"eval.k=\[1, 3\]: each k must be in 1..eval.n=2"),
    ({"n": 4}, "greedy decoding gives n identical samples"),
    ({"std": "c++14"}, r"eval.std='c\+\+14': expected c\+\+17 or newer"),
    ({"sandbox": "docker"}, "eval.sandbox='docker'"),
    ({"run_timeout_s": 0}, "eval.run_timeout_s=0: must be > 0"),
    ({"workers": -1}, "eval.workers=-1: must be >= 0"),
    # g++ reads -ansi as -std=c++98: the shipped references fail to compile under it
    ({"flags": ["-O1", "-ansi"]}, "eval.flags: -ansi would replace eval.std=c"),
    ({"eof_markers": ["<|bos|>", ""]}, "eval.eof_markers: '' would end every completion at once"),
    # resource limits prlimit takes: finite, under a day and a PiB
    ({"run_timeout_s": float("inf")}, "eval.run_timeout_s=inf: must be <= 86400"),
    ({"max_file_kb": 10**18}, "eval.max_file_kb=1000000000000000000: must be <= "),
])
def test_config_check_names_the_field(changes, message):
    with pytest.raises(ConfigError, match=message):
        check(EvalConfig(**changes))


def test_newer_standards_are_accepted_and_compile():
    for std in ("c++17", "c++20", "gnu++23", "c++2b"):
        _, records = evaluate([ADD], {"add": [ADD.reference]}, EvalConfig(std=std))
        assert [r["outcome"] for r in records] == ["passed"], (std, records)


@pytest.mark.parametrize("changes, message", [
    ({"gxx": "no-such-g++"}, "eval.gxx='no-such-g\\+\\+': compiler not found"),
    ({"flags": ["-fno-such-flag"]}, "an empty C\\+\\+ program does not compile and run"),
    ({"std": "c++26"}, "an empty C\\+\\+ program does not compile and run"),  # g++ 12 lacks it
])
def test_a_broken_toolchain_is_one_clear_error(changes, message):
    with pytest.raises(ConfigError, match=message):
        evaluate([ADD], {"add": [ADD.reference]}, EvalConfig(**changes))


@pytest.mark.parametrize("changes, said", [
    ({"run_memory_mb": 1}, "failed to map segment"),  # the sandbox's own loader, out of memory
    ({"max_processes": 1}, "Resource temporarily unavailable"),  # bwrap's namespaces need two
])
def test_limits_the_sandbox_cannot_start_under_are_named_not_the_compiler(changes, said):
    """Limits too tight for the sandbox itself: the error says so, not that the compiler, its
    flags or standard are wrong (it did, the compile being the first thing run)."""
    with pytest.raises(ConfigError) as e:
        evaluate([ADD], {"add": [ADD.reference]}, EvalConfig(**changes))
    assert str(e.value).startswith("eval.sandbox=auto: /bin/true does not start in the "
                                   "sandbox (bwrap) under the eval's limits"), str(e.value)
    assert said in str(e.value) and "eval.gxx" not in str(e.value)


def installed_compiler(prefix: Path, script: str = 'exec g++ "$@"\n') -> str:
    """A g++ at ``prefix``/bin: a shell script ending in ``script`` (by default: the real g++)."""
    (prefix / "bin").mkdir(parents=True)
    (prefix / "bin" / "g++").write_text("#!/bin/sh\n" + script)
    (prefix / "bin" / "g++").chmod(0o755)
    return str(prefix / "bin" / "g++")


@pytest.fixture
def opt_dir():
    """A prefix for a compiler that a sandbox uid can read: not in tmp_path (private to this
    user), and not in /tmp (the sandbox has a /tmp of its own)."""
    opt = Path(tempfile.mkdtemp(prefix="xtrain-opt-", dir="/var/tmp"))
    opt.chmod(0o755)
    yield opt
    shutil.rmtree(opt)


def test_a_compiler_installed_in_a_dir_holding_homes_or_runs_is_refused(tmp_path, monkeypatch, opt_dir):
    """The sandbox shows the generated programs the compiler's install prefix (its bin/'s parent),
    read-only. g++ in ~/bin made that the home directory (~/.netrc holds the W&B key, and a
    program's output is kept in the records), and in ~/.local/bin all of ~/.local; one prefix
    of its own (/opt/gcc-13) is fine."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    with pytest.raises(ConfigError, match=rf"eval.gxx=.*: installed under {tmp_path}/home, which "
                                          "holds the home directory"):
        evaluate([ADD], {"add": [ADD.reference]},
                 EvalConfig(gxx=installed_compiler(tmp_path / "home")))
    # a prefix inside the home directory shows all of it (pip's user installs, keyrings)
    with pytest.raises(ConfigError, match=rf"installed under {tmp_path}/home/.local, inside the home "
                                          rf"directory \({tmp_path}/home\)"):
        evaluate([ADD], {"add": [ADD.reference]},
                 EvalConfig(gxx=installed_compiler(tmp_path / "home" / ".local")))
    monkeypatch.chdir(tmp_path / "home")
    monkeypatch.setenv("HOME", "/nonexistent-home")
    with pytest.raises(ConfigError, match=f"installed under {tmp_path}, which holds the working dir"):
        evaluate([ADD], {"add": [ADD.reference]}, EvalConfig(gxx=installed_compiler(tmp_path)))
    _, records = evaluate([ADD], {"add": [ADD.reference]},
                          EvalConfig(gxx=installed_compiler(opt_dir / "gcc")))
    assert [r["outcome"] for r in records] == ["passed"] and os.getcwd() == str(tmp_path / "home")


def test_a_compile_that_fails_without_a_message_says_how_it_ended(opt_dir):
    """A compile_error record with an empty compiler message said nothing of its cause (one came
    up in a CI run). A compiler that exits 1 or is killed by SIGKILL without a word, for one
    problem only (the toolchain check compiles an empty program first), is recorded with how it
    ended."""
    gxx = installed_compiler(opt_dir, 'grep -q "neg(4)" main.cpp && exit 1\n'
                                      'grep -q "add(2, 3)" main.cpp && kill -9 $$\n'
                                      'exec g++ "$@"\n')
    _, records = evaluate([ADD, NEG], {"add": [ADD.reference], "neg": [NEG.reference]},
                          EvalConfig(gxx=gxx))
    said = {r["id"]: (r["outcome"], r["compiler_message"]) for r in records}
    assert said == {"add": ("compile_error", "the compiler failed without a message (SIGKILL)"),
                    "neg": ("compile_error", "the compiler failed without a message (exit 1)")}


def test_prepare_checks_config_file_and_toolchain_up_front(tmp_path):
    assert len(prepare(EvalConfig())) >= 40
    with pytest.raises(ProblemFileError, match="does not exist"):
        prepare(EvalConfig(cpp_file=str(tmp_path / "absent.jsonl")))
    with pytest.raises(ConfigError, match="an empty C\\+\\+ program does not compile"):
        prepare(EvalConfig(flags=["-fno-such-flag"]))


def test_a_benchmark_whose_reference_fails_its_own_tests_is_refused_up_front(tmp_path):
    """Every sample of such a problem would fail: every model scores 0 on it, unnoticed."""
    path = tmp_path / "bench.jsonl"
    wrong = {**ADD.__dict__, "id": "add_wrong", "reference": "  return a - b;\n}\n"}
    path.write_text("".join(json.dumps(p) + "\n" for p in (ADD.__dict__, NEG.__dict__, wrong)))
    with pytest.raises(ConfigError, match=rf"^eval.cpp_file={path}: the reference of 1 problem\(s\) "
                                          r"does not pass its own tests, so no sample could "
                                          r"\(add_wrong\); 'add_wrong': wrong_answer, exit code 1: "
                                          r"add\(2, 3\) != 5"):
        prepare(EvalConfig(cpp_file=str(path)))
    path.write_text("".join(json.dumps(p) + "\n" for p in (ADD.__dict__, NEG.__dict__)))
    assert [p.id for p in prepare(EvalConfig(cpp_file=str(path)))] == ["add", "neg"]


def test_generate_interface_cuts_continuations_and_writes_records(gcs_bucket):
    calls = []

    def generate(prompts: list[str], n: int) -> list[list[str]]:
        """Stands in for the model's sampler (the training code adapts it to this shape)."""
        calls.append((prompts, n))
        return [["  return a + b;\n}\n\nint main() { return 7; }\n",  # runs on past the function
                 "  return a - b;\n}\n<|bos|>#include <x>\n"],  # wrong, then the next document
                ["  return -a;\n<|endoftext|>}\n",  # the marker cuts before the brace
                 "  return 0 - a;\n}"]]

    url = f"{gcs_bucket[0]}/runs/r1/evals/cpp_step100.jsonl"
    cfg = EvalConfig(n=2, k=[1, 2], temperature=0.7)
    scores, records = generate_and_evaluate(generate, [ADD, NEG], cfg, url)
    assert calls == [([ADD.prompt, NEG.prompt], 2)]
    assert [r["code"] for r in records] == ["  return a + b;\n}\n", "  return a - b;\n}\n",
                                            "  return -a;\n", "  return 0 - a;\n}\n"]
    assert [r["outcome"] for r in records] == ["passed", "wrong_answer", "compile_error", "passed"]
    assert "add(2, 3) != 5" in records[1]["test_output"]
    assert "error:" in records[2]["compiler_message"]
    assert records[2]["run_s"] is None and records[0]["run_s"] > 0
    assert [r["exit_code"] for r in records] == [0, 1, None, 0]
    assert scores["cpp_pass_rate"] == 0.5 and scores["cpp_compile_rate"] == 0.75
    assert scores["cpp_pass@2"] == 1.0 and scores["cpp_pass@1/hard"] == 0.5
    assert scores["cpp_eval_seconds"] > 0 and scores["cpp_generate_seconds"] > 0
    with fsspec.open(url, "r") as f:
        written = [json.loads(line) for line in f]
    assert written == records


@pytest.mark.parametrize("directive", ["#define add(a, b) 5", "  /* */ #define add(a, b) 5",
                                       "/* # */ #define add(a, b) 5", "%:define add(a, b) 5",
                                       "#\\\ndefine add(a, b) 5", "\0#define add(a, b) 5"])
def test_a_completion_with_a_preprocessor_directive_is_not_compiled(directive):
    """A macro after the function rewrites the tests that follow (``add(2, 3)`` becomes 5): each
    spelling of a directive (after a comment, one holding a '#' too, as a digraph, spliced,
    after a NUL the compiler ignores) would pass them."""
    _, (record,) = evaluate([ADD], {"add": [f"  return 0;\n}}\n{directive}\n"]}, EvalConfig())
    assert (record["outcome"], record["compiled"], record["compile_s"]) == ("compile_error", False, None)
    assert record["compiler_message"].startswith("not compiled: a preprocessor directive in the "
                                                 "completion (")


def test_generate_with_the_wrong_shape_is_refused():
    with pytest.raises(ValueError, match="expected 1 per prompt"):
        generate_and_evaluate(lambda prompts, n: [[]], [ADD], EvalConfig())


def test_missing_completions_are_refused():
    with pytest.raises(ValueError, match="no completions for problem\\(s\\) neg"):
        evaluate([ADD, NEG], {"add": [ADD.reference]}, EvalConfig())


def test_pass_at_k_needs_at_least_k_samples():
    """With fewer than k samples pass@k is undefined (a problem none of them passed would score
    1.0): refused, by the estimator and by evaluate."""
    with pytest.raises(ValueError, match="pass@5 from 1 samples, 0 passed"):
        pass_at_k(1, 0, 5)
    with pytest.raises(ValueError, match="fewer than 2 completions \\(eval.k=\\[1, 2\\]\\) for "
                                         "problem\\(s\\) neg"):
        evaluate([ADD, NEG], {"add": [ADD.reference] * 2, "neg": ["  return 1;\n}\n"]},
                 EvalConfig(n=2, k=[1, 2], temperature=0.8))


def test_write_records_creates_local_parents(tmp_path):
    path = tmp_path / "run" / "evals" / "cpp.jsonl"
    write_records([{"id": "a"}, {"id": "b"}], str(path))
    assert path.read_text() == '{"id": "a"}\n{"id": "b"}\n'


def test_eval_config_is_a_structured_config():
    """The lead registers EvalConfig as the `eval` group: it must compose and type-check."""
    from omegaconf import OmegaConf, ValidationError

    cfg = OmegaConf.merge(OmegaConf.structured(EvalConfig),
                          OmegaConf.from_dotlist(["n=5", "k=[1,5]", "temperature=0.8"]))
    check(cfg)
    assert isinstance(OmegaConf.to_object(cfg), EvalConfig)
    with pytest.raises(ValidationError):
        OmegaConf.merge(OmegaConf.structured(EvalConfig), {"run_timeout_s": "soon"})
    with pytest.raises(ConfigError, match="eval.k=\\[1, 6\\]"):
        check(OmegaConf.merge(cfg, {"k": [1, 6]}))
