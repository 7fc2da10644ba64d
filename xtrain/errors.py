"""Errors the CLI reports in one line, without a traceback, each with its exit code: refused input
(one exception family), and a run that lost one of its processes."""

from __future__ import annotations

EXIT_REFUSED = 2  # every refused input: config, data, checkpoint, environment
EXIT_PEER_LOST = 3  # another process of a multi-process run vanished


class InputError(ValueError):
    """Input xtrain refuses; the message names the field or path and what is wrong with it."""

    kind = "input"  # the CLI prints "xtrain: <kind> error: <message>"


class ConfigError(InputError):
    """A config value is wrong; the message names the field and shows the arithmetic."""

    kind = "config"


class DataError(InputError):
    """Bad or missing data; the message names the path."""

    kind = "data"


class PeerLost(RuntimeError):
    """Another process of the run vanished (killed, crashed, its host gone) and the collectives
    cannot go on; the message names it. Re-running the command resumes from the newest
    committed checkpoint."""
