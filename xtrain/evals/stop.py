"""The stop rule: cut a raw model continuation where the function the prompt opened ends.

A prompt ends inside a function body (after its opening brace). The model keeps writing past the
function (another function, a ``main``, the next file), so the completion is cut right after the
``}`` that brings the brace depth of ``prompt + completion`` back to 0, or at an end-of-file
marker, whichever comes first. Braces inside string, character and raw-string literals and
comments do not count. No C++ tokenizer library for Python handles partial code and raw strings
without a compiler toolchain (libclang), so this small scanner does only what the rule needs.
"""

from __future__ import annotations

_IDENT = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.")
_RAW_PREFIXES = ("R", "u8R", "uR", "UR", "LR")


def _token_before(text: str, i: int) -> str:
    """The identifier or number that ends right before ``text[i]`` (empty if none)."""
    j = i
    while j > 0 and text[j - 1] in _IDENT:
        j -= 1
    return text[j:i]


def _in_number(text: str, i: int) -> bool:
    """Whether the ``'`` at ``text[i]`` continues a number (a digit separator: ``1'000``,
    ``0xFFFF'FFFF'FFFF``, whose digits before a separator may be letters): the run of word
    characters and separators before it starts with a digit."""
    j = i
    while j > 0 and (text[j - 1] in _IDENT or text[j - 1] == "'"):
        j -= 1
    return text[j:i][:1].isdigit()


def scan(text: str, stop_from: int | None = None) -> tuple[int, int | None]:
    """Brace depth at the end of ``text`` (or where it stopped), and, when ``stop_from`` is
    given, the index right after the first ``}`` at or after ``stop_from`` that brings the depth
    back to 0 (None if none). Unterminated literals or comments at the end leave the depth where
    it was."""
    depth, i, n = 0, 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            end = text.find("\n", i)
            i = n if end < 0 else end + 1
            continue
        if text.startswith("/*", i):
            end = text.find("*/", i + 2)
            i = n if end < 0 else end + 2
            continue
        if c == '"' and _token_before(text, i) in _RAW_PREFIXES:
            # R"delim( ... )delim": no escapes inside, ends only at the matching delimiter.
            open_paren = text.find("(", i)
            delim = text[i + 1:open_paren] if open_paren >= 0 else ""
            end = text.find(")" + delim + '"', open_paren + 1) if open_paren >= 0 else -1
            i = n if end < 0 else end + len(delim) + 2
            continue
        if c == "'" and _in_number(text, i):
            i += 1  # digit separator (1'000'000), not a character literal
            continue
        if c in "\"'":
            i = _skip_quoted(text, i, c)
            continue
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0 and stop_from is not None and i >= stop_from:
                return depth, i + 1
        i += 1
    return depth, None


def _skip_quoted(text: str, i: int, quote: str) -> int:
    """Index after the literal opened by ``quote`` at ``i`` (backslash escapes; a newline ends
    an unterminated literal, as it does for the compiler)."""
    j = i + 1
    while j < len(text):
        if text[j] == "\\":
            j += 2
            continue
        if text[j] == quote or text[j] == "\n":
            return j + 1
        j += 1
    return len(text)


def prompt_depth(prompt: str) -> int:
    """Brace depth at the end of a prompt (>= 1 when the prompt ends inside a function)."""
    return scan(prompt)[0]


def cut(prompt: str, raw: str, eof_markers: list[str] | tuple[str, ...] = ()) -> str:
    """The part of ``raw`` that completes the function the prompt opened (through its closing
    brace, plus a newline). Without a closing brace the text up to the first end-of-file marker,
    or all of it (it will not compile, which is the honest score)."""
    for marker in eof_markers:
        at = raw.find(marker)
        if at >= 0:
            raw = raw[:at]
    _, end = scan(prompt + raw, stop_from=len(prompt))
    if end is None:
        return raw
    return raw[:end - len(prompt)] + "\n"


def ended(prompt: str, raw: str, eof_markers: list[str] | tuple[str, ...] = ()) -> bool:
    """Whether ``raw`` already holds everything :func:`cut` keeps (generation can stop)."""
    if any(marker in raw for marker in eof_markers):
        return True
    return scan(prompt + raw, stop_from=len(prompt))[1] is not None
