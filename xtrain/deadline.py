"""The deadline a remote store answers within (``data.remote_timeout_s``): a bucket that hangs,
or whose client retries for minutes, is refused in one line naming it."""

from __future__ import annotations

import threading

from xtrain.errors import InputError, StorageError, left_running
from xtrain.paths import is_local


def within(seconds: float, what: str, check):
    """``check()``, refused when it does not answer in time (a remote store that hangs or
    retries for minutes); its own refusals pass through."""
    outcome: dict = {}

    def target():
        try:
            outcome["value"] = check()
        except BaseException as e:  # noqa: BLE001  (handed to the caller's thread)
            outcome["error"] = e

    worker = threading.Thread(target=target, daemon=True, name="xtrain-input-check")
    worker.start()
    worker.join(seconds)
    if worker.is_alive():
        left_running(worker)
        raise StorageError(f"{what}: no answer within {seconds:g} s (network, or credentials: "
                        "gcloud auth application-default login); data.remote_timeout_s sets the wait")
    error = outcome.get("error")
    if isinstance(error, InputError):
        raise error
    if error is not None:
        raise StorageError(f"{what}: {type(error).__name__}: {error}") from error
    return outcome.get("value")


def answered(seconds: float, urls: list, check):
    """``check()``, within ``seconds`` when one of ``urls`` is remote."""
    remote = [u for u in urls if u and not is_local(u)]
    if not remote:
        return check()
    return within(seconds, ", ".join(sorted({"/".join(u.split("/")[:3]) for u in remote})), check)
