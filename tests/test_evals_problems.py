"""The shipped C++ benchmark and the benchmark-file loader.

The shipped benchmark is judged here in full: every reference solution must compile and pass,
and a stub completion (``return {};``) must fail every problem, so no hidden test is vacuous.
"""

from __future__ import annotations

import json
from collections import Counter

import fsspec
import pytest

from xtrain.evals import EvalConfig, ProblemFileError, evaluate, load_problems

STUB = "  return {};\n}\n"  # a value-initialised result: compiles for every shipped signature


def test_shipped_benchmark_size_and_spread():
    problems = load_problems()
    spread = Counter(p.difficulty for p in problems)
    assert len(problems) >= 40
    assert spread["easy"] >= 12 and spread["medium"] >= 12 and spread["hard"] >= 10, spread


def test_every_reference_passes_and_every_stub_fails(tmp_path):
    problems = load_problems()
    completions = {p.id: [p.reference, STUB] for p in problems}
    records_path = tmp_path / "evals" / "cpp.jsonl"
    scores, records = evaluate(problems, completions, EvalConfig(), str(records_path))
    references = [r for r in records if r["sample"] == 0]
    stubs = [r for r in records if r["sample"] == 1]
    failed = [(r["id"], r["outcome"], r["compiler_message"][:300], r["test_output"][:300])
              for r in references if r["outcome"] != "passed"]
    assert failed == []
    vacuous = [r["id"] for r in stubs if r["outcome"] == "passed"]
    assert vacuous == []
    assert scores["cpp_compile_rate"] == pytest.approx(
        1.0 - sum(not r["compiled"] for r in stubs) / len(records))
    assert scores["cpp_pass_rate"] == 0.5
    for difficulty in ("easy", "medium", "hard"):
        assert scores[f"cpp_pass_rate/{difficulty}"] == 0.5
        assert scores[f"cpp_pass@1/{difficulty}"] == 0.5
    written = [json.loads(line) for line in records_path.read_text().splitlines()]
    assert [(r["id"], r["sample"], r["outcome"]) for r in written] == \
        [(r["id"], r["sample"], r["outcome"]) for r in records]
    assert written[0]["code"] == problems[0].reference and written[0]["compile_s"] > 0


GOOD = {"id": "add", "difficulty": "easy", "prompt": "int add(int a, int b) {\n",
        "reference": "  return a + b;\n}\n",
        "tests": "int main() {\n  return add(2, 3) == 5 ? 0 : 1;\n}\n"}


def write_lines(path, lines):
    path.write_text("".join(line + "\n" for line in lines))
    return str(path)


def good(**changes):
    return json.dumps({**GOOD, **changes})


@pytest.mark.parametrize("bad_line, message", [
    ("{not json", "bad JSON"),
    ("[1, 2]", "expected a JSON object, got list"),
    (json.dumps({k: v for k, v in GOOD.items() if k != "tests"} | {"id": "x"}),
     "missing field(s) tests"),
    (good(id="x", test="typo"), "unknown field(s) test"),
    (good(id="x", difficulty="trivial"), "unknown difficulty 'trivial'"),
    (good(id="x", prompt=7), "field 'prompt' must be a non-empty string"),
    (good(id="has space"), "id 'has space'"),
    (good(id="x", prompt="int add(int a, int b);\n"), "prompt must end inside the function"),
    (good(id="x", reference="  return a + b;\n}\nint more() { return 1; }\n"),
     "reference must end with the brace"),
    (good(id="x", tests="static_assert(true);\n"), "tests must define `int main()`"),
    (good(), "duplicate id 'add' (first on line 1)"),
    # JSON's escapes spell half a surrogate pair, which no UTF-8 file holds (the sandbox writes
    # the code out as UTF-8)
    (good(id="x", prompt="// Return a + b. \ud800\n" + GOOD["prompt"]),
     "field 'prompt' holds '\\ud800' at character 17, half a surrogate pair"),
])
def test_malformed_line_names_file_line_and_fault(tmp_path, bad_line, message):
    path = write_lines(tmp_path / "bench.jsonl", [good(), "", bad_line])
    with pytest.raises(ProblemFileError) as info:
        load_problems(path)
    assert str(info.value).startswith(f"{path}:3: ")
    assert message in str(info.value)


def test_lines_end_at_newlines_only(tmp_path):
    """JSONL separates lines with \\n alone: a string may hold U+2028, U+2029 or U+0085 (JSON
    writes them unescaped), which Python's splitlines would take for line ends."""
    path = tmp_path / "bench.jsonl"
    texts = ["// sums\u2028two\n", "// sums\u2029two\n", "// sums\x85two\n"]
    path.write_text("".join(json.dumps({**GOOD, "id": f"add{i}", "prompt": t + GOOD["prompt"]},
                                       ensure_ascii=False) + "\n" for i, t in enumerate(texts)))
    assert [p.prompt.split("\n")[0] for p in load_problems(str(path))] == [t[:-1] for t in texts]
    path.write_text(good() + "\n" + '{"id": "x", "prompt": "open\n')
    with pytest.raises(ProblemFileError, match=rf"^{path}:2: bad JSON \(Unterminated string "
                                               r"starting at: column 23\)$"):
        load_problems(str(path))


def test_empty_and_missing_files(tmp_path):
    with pytest.raises(ProblemFileError, match="no problems"):
        load_problems(write_lines(tmp_path / "empty.jsonl", ["", "  "]))
    with pytest.raises(ProblemFileError, match="does not exist"):
        load_problems(str(tmp_path / "absent.jsonl"))


def test_a_file_that_is_not_utf8_text_or_a_directory_is_refused_naming_it(tmp_path):
    latin1 = tmp_path / "latin1.jsonl"
    latin1.write_bytes((good() + "\n").encode() + '{"id": "caf\xe9"}\n'.encode("latin-1"))
    with pytest.raises(ProblemFileError, match=rf"^C\+\+ benchmark file {latin1} is not UTF-8 text "
                                               r"\(invalid continuation byte at byte \d+\)"):
        load_problems(str(latin1))
    with pytest.raises(ProblemFileError, match=rf"^C\+\+ benchmark file {tmp_path} cannot be read "
                                               r"\(IsADirectoryError: Is a directory\)"):
        load_problems(str(tmp_path))


@pytest.mark.parametrize("url, why", [("htps://example.com/cpp.jsonl", "ValueError: Protocol not known: htps"),
                                      ("s3://bucket/cpp.jsonl", "ImportError: Install s3fs")])
def test_a_url_fsspec_cannot_open_is_refused_naming_it(url, why):
    """A mistyped protocol, or one whose package is not installed here (nothing is fetched)."""
    with pytest.raises(ProblemFileError, match=rf"^C\+\+ benchmark file {url} cannot be read \({why}"):
        load_problems(url)


def test_a_team_benchmark_loads_from_gcs(gcs_bucket):
    url = f"{gcs_bucket[0]}/benchmarks/cpp.jsonl"
    with fsspec.open(url, "w") as f:
        f.write(good() + "\n" + good(id="add2") + "\n")
    assert [p.id for p in load_problems(url)] == ["add", "add2"]
    with fsspec.open(url, "w") as f:
        f.write(good() + "\n{oops\n")
    with pytest.raises(ProblemFileError, match=f"^{url}:2: bad JSON"):
        load_problems(url)
