"""Refused input: one exception family, one exit code (the CLI prints one line, no traceback)."""

from __future__ import annotations

EXIT_REFUSED = 2  # every refused input: config, data, checkpoint, environment


class InputError(ValueError):
    """Input xtrain refuses; the message names the field or path and what is wrong with it."""

    kind = "input"  # the CLI prints "xtrain: <kind> error: <message>"


class ConfigError(InputError):
    """A config value is wrong; the message names the field and shows the arithmetic."""

    kind = "config"


class DataError(InputError):
    """Bad or missing data; the message names the path."""

    kind = "data"
