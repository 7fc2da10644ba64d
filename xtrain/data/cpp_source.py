"""C/C++ sources for a corpus build (xtrain/data/corpus.py): finding the files under source trees,
and cutting each file at top-level boundaries (functions, classes, namespaces, declarations) into
chunks that fit a token budget, descending into namespace and class bodies that are too big."""

from __future__ import annotations

import bisect
import re

from xtrain.errors import DataError
from xtrain.paths import as_url, url_to_fs

CPP_SUFFIXES = (".h", ".hh", ".hpp", ".hxx", ".c", ".cc", ".cpp", ".cxx", ".tcc", ".ipp", ".inl")


# How an extensionless header (libstdc++'s ``<vector>``, Qt's ``QString``) opens, after a UTF-8
# byte order mark if any: a C/C++ comment or a preprocessor directive, written without a space
# after the ``#`` (``# include this file...`` opens a Makefile or shell comment). Only the opening
# counts: a Makefile or README that mentions ``#include`` or ``namespace`` further down does not.
_CPP_OPENING = re.compile(rb"(?:\xef\xbb\xbf)?\s*(?://|/\*|#(?:include\s*[<\"]"
                          rb"|(?:pragma|if|ifdef|ifndef|define|import)\s))")


def looks_like_cpp(path: str, head: bytes) -> bool:
    """C/C++ by suffix; extensionless headers by how they open (``_CPP_OPENING``); never a file
    with a NUL byte in its first bytes (binary, whatever its name)."""
    if b"\0" in head:
        return False
    if path.endswith(CPP_SUFFIXES):
        return True
    name = path.rsplit("/", 1)[-1]
    if "." in name:
        return False
    return _CPP_OPENING.match(head) is not None


def find_sources(roots: list[str]) -> list[tuple[str, str]]:
    """(url, fingerprint) of every C/C++ file under ``roots``, sorted; fingerprint = size+mtime.
    A symlink to a file counts as that file (a link to a directory is not followed). A root that
    does not exist is refused (a typo would leave its code out of the corpus without a word)."""
    found = []
    for root in roots:
        fs, base = url_to_fs(root)
        if not fs.exists(base):
            raise DataError(f"{root} does not exist" + (
                " (it comes with g++)" if root.rstrip("/") == "/usr/include/c++" else ""))
        for path, info in fs.find(base, detail=True).items():
            linked_file = info.get("islink") and fs.isfile(path)  # (its size and mtime: the file's)
            if (info.get("type") != "file" and not linked_file) or info.get("size", 0) == 0:
                continue
            with fs.open(path, "rb") as f:
                head = f.read(2048)
            if looks_like_cpp(path, head):
                found.append((as_url(fs, path), f"{info.get('size')}:{info.get('mtime', info.get('updated', ''))}"))
    return sorted(found)


# --- chunking -------------------------------------------------------------------------------


# Lexemes that matter for finding boundaries; everything else is skipped by the regex engine.
_LEXEME = re.compile(
    r"""(?P<pp>^[ \t]*\#(?:[^\n]*\\\n)*[^\n]*(?:\n|$))"""  # preprocessor line (+ continuations)
    r"""|//[^\n]*|/\*.*?(?:\*/|\Z)"""  # comments
    r"""|"(?:\\.|[^"\\\n])*"?|'(?:\\.|[^'\\\n])*'?"""  # string and char literals
    r"""|(?P<brace>[{}])|(?P<semi>;)""",
    re.M | re.S)
_TRAILER = re.compile(r"[ \t;]*(?://[^\n]*)?\n?")  # "};  // end of namespace x"


def top_level_units(text: str) -> list[str]:
    """Split at brace depth 0 after a closing ``}`` (plus a trailing ``;``), after ``;``, and after
    preprocessor lines. Strings, chars and comments are skipped, so braces inside them don't count.
    The concatenation of the units is exactly ``text``."""
    units, start, depth = [], 0, 0

    def cut(end: int):
        nonlocal start
        if end > start:
            units.append(text[start:end])
            start = end

    for m in _LEXEME.finditer(text):
        if m.group("pp") is not None:
            if depth == 0:
                cut(m.end())
        elif m.group("brace") == "{":
            depth += 1
        elif m.group("brace") == "}":
            depth = max(0, depth - 1)
            if depth == 0:
                cut(_TRAILER.match(text, m.end()).end())
        elif m.group("semi") and depth == 0:
            cut(m.end() + (1 if text.startswith("\n", m.end()) else 0))
    cut(len(text))
    return units


def _split_block(unit: str) -> list[str] | None:
    """``head { body } tail`` -> [head{, *units of body, }tail], or None if not a brace block.
    Braces are found with the lexer, so one in a comment or string is not taken for the block's."""
    braces = [m for m in _LEXEME.finditer(unit) if m.group("brace")]
    if len(braces) < 2 or braces[0].group("brace") != "{" or braces[-1].group("brace") != "}":
        return None
    open_at, close_at = braces[0].start(), braces[-1].start()
    inner = top_level_units(unit[open_at + 1:close_at])
    if len(inner) <= 1:
        return None
    return [unit[:open_at + 1]] + inner + [unit[close_at:]]


def chunk_source(text: str, token_starts: list[int], budget: int) -> list[str]:
    """Greedily pack top-level units into chunks of at most ``budget`` tokens. A unit over budget
    that is a namespace/class-like block is split into its members; a single function over budget
    is split at line boundaries (the only place a function body is cut).

    ``token_starts`` are the character offsets at which the file's tokens start (from one
    tokenization of the whole file), so counting a unit's tokens is two bisections.
    """
    chunks: list[str] = []
    current, current_tokens = [], 0

    def count(a: int, b: int) -> int:
        return bisect.bisect_left(token_starts, b) - bisect.bisect_left(token_starts, a)

    def flush():
        nonlocal current, current_tokens
        if current:
            chunks.append("".join(current))
        current, current_tokens = [], 0

    def add(unit: str, offset: int):
        nonlocal current_tokens
        n = count(offset, offset + len(unit))
        # one character over budget (bytes the vocabulary never merged) stays whole
        if n > budget and len(unit) > 1:
            parts = _split_block(unit)
            if parts is None:
                parts = unit.splitlines(keepends=True)
                if len(parts) == 1:  # one enormous line: cut by characters
                    step = max(1, len(unit) * budget // (2 * n))
                    parts = [unit[i:i + step] for i in range(0, len(unit), step)]
            for part in parts:
                add(part, offset)
                offset += len(part)
            return
        if current_tokens + n > budget:
            flush()
        current.append(unit)
        current_tokens += n

    offset = 0
    for unit in top_level_units(text):
        add(unit, offset)
        offset += len(unit)
    flush()
    return [c for c in chunks if c.strip()]
