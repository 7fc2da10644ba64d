"""The stop rule: a raw continuation is cut where the prompt's function ends."""

from __future__ import annotations

from xtrain.evals.stop import cut, prompt_depth

PROMPT = "#include <string>\n\n// Return a string.\nstd::string f(int n) {\n"


def test_cuts_after_the_closing_brace_of_the_function():
    raw = "  if (n > 0) {\n    return \"pos\";\n  }\n  return \"neg\";\n}\n\nint main() { f(1); }\n"
    assert cut(PROMPT, raw) == "  if (n > 0) {\n    return \"pos\";\n  }\n  return \"neg\";\n}\n"


def test_braces_in_literals_and_comments_do_not_count():
    raw = ('  // a } in a comment\n  /* and } { here */\n  std::string s = "}}\\"}";\n'
           "  char c = '}';\n  char q = '\\'';\n  auto r = R\"x(a\"})x\";\n"
           "  int big = 1'000; if (big) { big = 2'0; }  // digit separators, not char literals\n"
           "  return s + c + q + r;\n}\nint next() { return 0; }\n")
    body = raw[:raw.index("}\nint next")] + "}\n"
    assert cut(PROMPT, raw) == body


def test_separators_after_a_numbers_letters_are_digit_separators_too():
    """0xFFFF'FFFF: the digits before the second separator are letters (a hex number), an
    exponent's too; read as a character literal, the line's closing brace went with it."""
    prompt = "unsigned long long low48(unsigned long long x) {\n"
    for number in ("0xFFFF'FFFF'FFFFull", "0b1010'1010", "1.5e1'0"):
        body = f"  return x & {number}; }}\n"
        assert cut(prompt, body + "\nint main() { return 0; }\n") == body, number


def test_eof_marker_ends_the_completion_first():
    raw = "  return \"x\";\n<|bos|>// next document\n}\n"
    assert cut(PROMPT, raw, ["<|endoftext|>", "<|bos|>"]) == "  return \"x\";\n"


def test_marker_after_the_function_is_cut_by_the_brace():
    assert cut(PROMPT, "  return {};\n}\n<|bos|>junk", ["<|bos|>"]) == "  return {};\n}\n"


def test_no_closing_brace_keeps_everything():
    assert cut(PROMPT, "  return \"x\";\n  // ran out of tokens") == \
        "  return \"x\";\n  // ran out of tokens"


def test_helper_types_in_the_prompt_are_skipped():
    prompt = "struct P { int x; };\nstatic int g() { return 1; }\nint f(P p) {\n"
    assert prompt_depth(prompt) == 1
    assert cut(prompt, "  return p.x + g();\n}\nint h() {}\n") == "  return p.x + g();\n}\n"


def test_a_prompt_outside_any_function_has_depth_zero():
    assert prompt_depth("#include <vector>\nint f();\n") == 0
    assert prompt_depth("// { in a comment\nint f() {\n") == 1


def test_generation_ends_once_the_function_is_closed_or_a_marker_appears():
    from xtrain.evals.stop import ended

    assert not ended(PROMPT, "  if (n) {\n    return \"}\";\n  }\n")  # inner block, literal
    assert ended(PROMPT, "  if (n) {\n    return \"}\";\n  }\n  return \"\";\n}")
    assert ended(PROMPT, "  return \"x\";\n<|bos|>", ["<|bos|>"])
    assert not ended(PROMPT, "  return \"x\";\n<|bos", ["<|bos|>"])


def test_an_empty_body_is_cut_at_its_first_character():
    assert cut(PROMPT, "}\n\nint main() { f(1); }\n") == "}\n"


def test_an_unterminated_quote_ends_at_its_line_and_hides_no_brace_after_it():
    raw = '  return "oops;\n}\nint main() { return 0; }\n'
    assert cut(PROMPT, raw) == '  return "oops;\n}\n'


def test_a_raw_string_with_an_encoding_prefix_hides_its_braces():
    raw = '  auto s = u8R"d(}{)d";\n  return "";\n}\nint main() {}\n'
    assert cut(PROMPT, raw) == '  auto s = u8R"d(}{)d";\n  return "";\n}\n'
