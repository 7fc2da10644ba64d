"""Allowed ranges declared beside the schema fields (``limits(200, ge=1)``) and the check that
reports every value outside them (:func:`out_of_range`), before anything else runs."""

from __future__ import annotations

import typing
from dataclasses import field, fields, is_dataclass

from omegaconf import MISSING

_BOUNDS = {"ge": (">=", lambda v, b: v >= b), "gt": (">", lambda v, b: v > b),
           "le": ("<=", lambda v, b: v <= b), "lt": ("<", lambda v, b: v < b)}


def limits(default=MISSING, hint: str = "", **bounds):
    """A field's default and its allowed range, e.g. ``limits(200, ge=1)``; ``hint`` is added to
    the refusal. ``None`` (where the type allows it) always passes: it means "derive it"."""
    assert set(bounds) <= set(_BOUNDS), bounds
    return field(default=default, metadata={"bounds": bounds, "hint": hint})


def out_of_range(cfg, schema, prefix: str = "") -> list[str]:
    """Every field of ``cfg`` outside the range its ``schema`` dataclass declares (nested
    schemas included), as "field=value: must be ...", in schema order."""
    problems, types = [], typing.get_type_hints(schema)
    for f in fields(schema):
        value = cfg.get(f.name) if hasattr(cfg, "get") else getattr(cfg, f.name, None)
        path = f"{prefix}{f.name}"
        if is_dataclass(types[f.name]) and value is not None:
            problems += out_of_range(value, types[f.name], path + ".")
            continue
        bounds = f.metadata.get("bounds") or {}
        if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        broken = [f"{_BOUNDS[k][0]} {_number(b)}" for k, b in bounds.items()
                  if not _BOUNDS[k][1](value, b)]
        if broken:
            hint = f" ({f.metadata['hint']})" if f.metadata.get("hint") else ""
            problems.append(f"{path}={_number(value)}: must be {' and '.join(broken)}{hint}")
    return problems


def _number(x) -> str:
    return str(x) if isinstance(x, int) else f"{x:g}"  # (an int's every digit: a seed, a size)
