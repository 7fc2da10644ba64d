"""Refused input: one exception family, one exit code, one line on stderr (no traceback); and how
the CLI and the launchers report it, and a run that lost one of its processes."""

from __future__ import annotations

import logging
import os
import re
import sys
import threading
from pathlib import Path

EXIT_REFUSED = 2  # every refused input: config, data, checkpoint, environment
EXIT_LAUNCH_FAILED = 1  # a remote launch failed (a worker's job, an unreachable host)
EXIT_PEER_LOST = 3  # another process of a multi-process run vanished
EXIT_NOT_SAVED = 1  # training ended, but its final checkpoint could not be written
EXIT_INTERRUPTED = 130  # 128 + SIGINT: stopped at once (a second Ctrl-C), without a checkpoint
EXIT_STOPPED = 143  # 128 + SIGTERM: stopped before finishing; the same command resumes


class Terminated(BaseException):
    """SIGTERM outside training's own stop handling (xtrain/train/preemption.py sigterm_raises):
    raised in the main thread as KeyboardInterrupt is for SIGINT, so that what a run holds (its
    checkpoint lease, its run dir) is let go; a BaseException, so that no ``except Exception``
    takes it for an error of its own."""


class InputError(ValueError):
    """Input xtrain refuses; the message names the field or path and what is wrong with it."""

    kind = "input"  # the CLI prints "xtrain: <kind> error: <message>"


class ConfigError(InputError):
    """A config value is wrong; the message names the field and shows the arithmetic."""

    kind = "config"


class TargetUnready(ConfigError):
    """A launch's TPU is not READY, or gcloud cannot describe it: a refusal for a launch of its
    own; a fleet asks gcloud about the VM again (it may have gone down since the fleet looked)."""


class DataError(InputError):
    """Bad or missing data; the message names the path."""

    kind = "data"


class StorageError(InputError):
    """Remote storage (a bucket) that does not answer in time, or fails; names the URL."""

    kind = "storage"


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


class LaunchError(RuntimeError):
    """A remote step of a launch failed (a worker's job, an unreachable host); names the worker."""

    kind = "launch"


class VmUnavailable(LaunchError):
    """The workers refused the job before anything of it started (another xtrain job or program
    holds them, unreachable, missing tools, a failed sync or install): the machine's problem, not
    the job's. A pool (xtrain/launcher/pool.py) gives the job to another VM."""


class PeerLost(RuntimeError):
    """Another process of the run vanished (killed, crashed, its host gone) and the collectives
    cannot go on; the message names it. Re-running the command resumes from the newest
    committed checkpoint."""

    kind = "peer"


class CheckpointNotWritten(RuntimeError):
    """Training ended, but storage kept failing its final checkpoint: the newest committed one
    (named) is older; re-running the command trains again from it."""

    kind = "checkpoint"


def is_refusal(ex: BaseException) -> bool:
    """Refused input (exit 2), a failed remote launch (exit 1), a lost process (exit 3), a final
    checkpoint not written (exit 1), or Hydra's composition errors."""
    from hydra.errors import CompactHydraException
    from omegaconf.errors import OmegaConfBaseException

    return isinstance(ex, (InputError, LaunchError, PeerLost, CheckpointNotWritten,
                           CompactHydraException, OmegaConfBaseException))


def one_line(ex: BaseException) -> str:
    """The refusal as one line: xtrain's message, or Hydra's and OmegaConf's multi-line reports
    folded (the field's full key first; a list of available options joined, without the
    ``_``-prefixed bases and Hydra's search path)."""
    from omegaconf.errors import OmegaConfBaseException

    if isinstance(ex, (InputError, LaunchError, PeerLost, CheckpointNotWritten)):
        return f"xtrain: {ex.kind} error: {ex}"
    if isinstance(ex, OmegaConfBaseException):  # refused by one of xtrain's resolvers?
        inner = ex.__cause__ or ex.__context__  # (OmegaConf wraps a resolver's error unchained)
        while inner is not None and not isinstance(inner, InputError):
            inner = inner.__cause__ or inner.__context__
        if inner is not None:
            return one_line(inner)
    cause = ex.__cause__ if isinstance(ex.__cause__, OmegaConfBaseException) else ex
    if isinstance(cause, OmegaConfBaseException) and getattr(cause, "full_key", None):
        return f"xtrain: config error: {cause.full_key}: {str(cause).splitlines()[0]}"
    lines = str(ex).split("Config search path:")[0].splitlines()
    text = [line.strip().rstrip(":") for line in lines
            if line.strip() and not line.startswith(("\t", "See https://"))]
    if getattr(ex, "override", None):  # an override Hydra's grammar cannot parse
        text.insert(0, f"cannot parse override {ex.override!r}")
    items = [line.strip() for line in lines if line.startswith("\t") and not line.strip().startswith("_")]
    missing = re.search(r"Could not load '([\w/]+)/[^'/]+'", str(ex))
    if missing and not items:  # an entry of a list-valued group (logger=[jsonl,wandbb]): Hydra lists
        text = [t.rstrip(".") for t in text] + [f"available options in '{missing[1]}'"]  # none
        items = _options(missing[1])
    return "xtrain: config error: " + "; ".join(text) + (": " + ", ".join(items) if items else "")


def _options(group: str) -> list[str]:
    from xtrain.paths import config_dir

    return sorted(p.stem for p in Path(config_dir(), group).glob("*.yaml") if not p.stem.startswith("_"))


def _unmasked(text: str) -> str:
    return text


# What masks secrets out of a line before it is printed (a refused value may have been read from
# a secret environment variable: ``${oc.env:HF_TOKEN}``): xtrain/observe/bundle.py's mask_secrets,
# set by the entry point (xtrain/cli.py), as this lowest layer cannot import it.
_mask = _unmasked


def printed_masked(mask) -> None:
    """Mask every line :func:`refuse` and :func:`warn` print with ``mask`` (text -> text)."""
    global _mask
    _mask = mask


# Threads left running past their deadline (xtrain/deadline.py within). The interpreter's exit
# stops a daemon thread where it stands, and one standing in native code that catches every C++
# exception (torch's, a storage client's) turns that stop into SIGABRT after the refusal's line.
_LEFT_RUNNING: list[threading.Thread] = []


def left_running(thread: threading.Thread) -> None:
    """Note a daemon thread given up on: a refusal then ends the process without finalizing."""
    _LEFT_RUNNING.append(thread)


def refuse(ex: BaseException) -> None:
    """End the process with the one line and the exit code of ``ex``."""
    print(_mask(one_line(ex)), file=sys.stderr, flush=True)
    codes = {LaunchError: EXIT_LAUNCH_FAILED, PeerLost: EXIT_PEER_LOST,
             CheckpointNotWritten: EXIT_NOT_SAVED}
    code = next((code for kind, code in codes.items() if isinstance(ex, kind)), EXIT_REFUSED)
    if any(thread.is_alive() for thread in _LEFT_RUNNING):
        logging.shutdown()  # (what exiting would have flushed)
        sys.stdout.flush()
        os._exit(code)
    sys.exit(code)


def unpickling_reason(error: BaseException) -> str:
    """An unpickling error of an untrusted file (a checkpoint, a tokenizer's token_bytes.pt) in
    one line, without torch's advice to load it with ``weights_only=False`` (which would run the
    file's code)."""
    # torch 2.9: the reason follows "WeightsUnpickler error:", its advice "Please use"
    text = str(error).split("WeightsUnpickler error:")[-1].split(" Please use")[0]
    lines = [line.strip() for line in text.splitlines() if line.strip() and "weights_only" not in line
             and not line.strip().startswith(("Weights only load failed", "Check the documentation"))]
    return " ".join(lines)[:300] or type(error).__name__


def warn(message: str) -> None:
    """A warning that does not stop the run, on stderr in the refusals' one-line form; during a
    run, through its console (xtrain/observe/console.py ConsoleLog, the one giving the xtrain
    logger handlers), so the run's console.log keeps it too."""
    line = f"xtrain: warning: {message}"
    console = logging.getLogger("xtrain")
    if console.handlers:
        console.warning(line)
    else:
        print(_mask(line), file=sys.stderr, flush=True)
