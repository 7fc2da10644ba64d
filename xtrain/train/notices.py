"""GCE preemption and maintenance notices: the VM's metadata server announces them before the
VM is stopped (a preemption at the same time as its ~30 s ACPI shutdown, host maintenance up to
60 s ahead), so a run need not wait for SIGTERM.

A daemon thread per key long-polls the metadata server (``?wait_for_change=true`` with the last
ETag, so no change is missed between two requests) and turns a notice into the same request as
SIGTERM: stop at the next agreed step boundary, checkpoint, exit 143
(xtrain/train/preemption.py). Off GCE nothing is started (:func:`watch`).

Hand-written on purpose: google-auth's metadata client is private API (``_metadata``) and its
on-GCE probe makes network round trips; this is a dozen lines of urllib.
"""

from __future__ import annotations

import sys
import threading
import urllib.error
import urllib.request
from pathlib import Path

GCE_METADATA_URL = "http://metadata.google.internal/computeMetadata/v1"
# key -> whether a value is a notice. A live migration (MIGRATE_ON_HOST_MAINTENANCE) keeps the VM
# running; TPU VMs and spot VMs are terminated (TERMINATE_ON_HOST_MAINTENANCE).
KEYS = {
    "instance/preempted": lambda value: value.strip().upper() == "TRUE",
    "instance/maintenance-event": lambda value: value.strip().upper().startswith("TERMINATE"),
}
_DMI_PRODUCT = Path("/sys/class/dmi/id/product_name")


def on_gce() -> bool:
    """A GCE VM (TPU VMs included) says so in its DMI product name; no network involved."""
    try:
        return "Google" in _DMI_PRODUCT.read_text()
    except OSError:
        return False


def watch(cfg, stop) -> NoticeWatcher | None:
    """Start watching the metadata server ``cfg`` (the ``preemption`` group) names, or the real one
    on GCE; None (nothing started) otherwise."""
    if not cfg.watch_notices:
        return None
    url = cfg.metadata_url or (GCE_METADATA_URL if on_gce() else None)
    if url is None:
        return None
    watcher = NoticeWatcher(url, stop.request)
    watcher.start()
    return watcher


class NoticeWatcher:
    """Calls ``on_notice(reason)`` once, from a daemon thread, when any key in :data:`KEYS`
    announces a stop."""

    POLL_TIMEOUT_S = 60  # the metadata server answers a long poll at the latest after this
    RETRY_S = 5.0  # after a failed request

    def __init__(self, base_url: str, on_notice):
        self.base_url, self.on_notice = base_url.rstrip("/"), on_notice
        self._done = threading.Event()
        self._threads = [threading.Thread(target=self._watch, args=(key,), daemon=True,
                                          name=f"xtrain-gce-notice-{key.rsplit('/', 1)[-1]}")
                         for key in KEYS]

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def stop(self) -> None:
        """Stop watching (the threads end after their current request; they are daemons)."""
        self._done.set()

    def _get(self, key: str, etag: str | None) -> tuple[str, str | None]:
        query = "" if etag is None else (f"?wait_for_change=true&last_etag={etag}"
                                         f"&timeout_sec={self.POLL_TIMEOUT_S}")
        request = urllib.request.Request(f"{self.base_url}/{key}{query}",
                                         headers={"Metadata-Flavor": "Google"})
        with urllib.request.urlopen(request, timeout=self.POLL_TIMEOUT_S + 10) as response:
            return response.read().decode(), response.headers.get("ETag")

    def _watch(self, key: str) -> None:
        noticed, etag, warned = KEYS[key], None, False
        while not self._done.is_set():
            try:
                value, etag = self._get(key, etag)
            except urllib.error.HTTPError as e:
                if e.code == 404:  # this key does not exist here: nothing to watch
                    return
                value = None
            except OSError:
                value = None
            if value is None:
                if not warned:
                    print(f"xtrain: warning: metadata server {self.base_url} not answering for "
                          f"{key}; retrying every {self.RETRY_S:.0f} s", file=sys.stderr, flush=True)
                    warned = True
                etag = None
                self._done.wait(self.RETRY_S)
                continue
            if noticed(value) and not self._done.is_set():
                self.on_notice(f"GCE notice {key}={value.strip()}")
                return
            if etag is None:  # a server without ETags cannot long-poll: plain polling
                self._done.wait(1.0)
