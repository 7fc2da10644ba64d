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


class CheckpointError(InputError):
    """A checkpoint to resume from is missing, incomplete or of another model; names the path."""

    kind = "checkpoint"


class EnvironmentMismatch(InputError):
    """This machine cannot run the config (e.g. a TPU profile where no TPU is attached)."""

    kind = "environment"


class RecompileError(InputError):
    """An XLA run compiled more graphs than trainer.max_compiles allows (a shape or constant that
    changes between steps); names the graph and torch_xla's reason."""

    kind = "recompile"
