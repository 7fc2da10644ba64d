"""GCE preemption and maintenance notices: the VM's metadata server announces them, so a run need
not wait for SIGTERM.

Three keys are watched, each by a daemon thread:

- ``instance/preempted`` turns TRUE when a spot or preemptible VM (TPU VMs included) is being
  preempted, at the start of its shutdown: seconds, not minutes, before the VM stops. It is
  long-polled (``?wait_for_change=true`` with the last ETag, so no change is missed between two
  requests).
- ``instance/upcoming-maintenance`` is where a TPU VM's host maintenance is announced, as a JSON
  object: ``maintenanceStatus`` (PENDING: scheduled, not started; ONGOING: under way),
  ``windowStartTime``/``windowEndTime`` (RFC 3339), ``type`` or ``maintenanceType`` (SCHEDULED,
  announced about seven days ahead; UNSCHEDULED, critical and announced with less notice),
  ``canReschedule``, ``latestWindowStartTime``. With nothing scheduled the answer is an error
  object (``{"error": "no notifications have been received yet, ..."}``) or an HTTP error. A
  notice is maintenance ONGOING, or a window that starts within ``preemption.maintenance_lead_s``
  (and has not already ended). The key is polled every :attr:`NoticeWatcher.MAINTENANCE_POLL_S`
  (a long poll when the server gives an ETag, so a new answer is seen at once; the window's start
  is checked against the clock after each answer); a 404, an error or an answer that is not JSON
  is "nothing scheduled" and the thread keeps watching, since a schedule can appear at any time.
- ``instance/maintenance-event`` (TERMINATE_ON_HOST_MAINTENANCE about a minute before the VM is
  stopped) is filled in only for VMs set to live-migrate or with a GPU attached, so on a TPU VM
  it most likely never changes. It is kept: one idle long poll costs nothing, and a VM that does
  fill it in gets the notice (its thread ends if the key does not exist).

A notice becomes the same request as SIGTERM: stop at the next agreed step boundary, checkpoint,
exit 143 (xtrain/train/preemption.py), except that the run records it as a notice's stop: the
launcher then waits for the VM's loss the maintenance lead longer, and re-runs the job even if
the VM stays up (xtrain/launcher/fleet.py). Off GCE nothing is started (:func:`watch`).

Hand-written on purpose: google-auth's metadata client is private API (``_metadata``) and its
on-GCE probe makes network round trips; this is a few dozen lines of urllib.
"""

from __future__ import annotations

import json
import sys
import threading
import time
import urllib.error
import urllib.request
from datetime import datetime, timezone
from pathlib import Path

GCE_METADATA_URL = "http://metadata.google.internal/computeMetadata/v1"
# Long-polled keys -> whether a value is a notice. A live migration (MIGRATE_ON_HOST_MAINTENANCE)
# keeps the VM running; TERMINATE_ON_HOST_MAINTENANCE stops it.
KEYS = {
    "instance/preempted": lambda value: value.strip().upper() == "TRUE",
    "instance/maintenance-event": lambda value: value.strip().upper().startswith("TERMINATE"),
}
UPCOMING_MAINTENANCE = "instance/upcoming-maintenance"
_DMI_PRODUCT = Path("/sys/class/dmi/id/product_name")


def on_gce() -> bool:
    """A GCE VM (TPU VMs included) says so in its DMI product name; no network involved."""
    try:
        return "Google" in _DMI_PRODUCT.read_text()
    except OSError:
        return False


def _rfc3339(value) -> datetime | None:
    if not isinstance(value, str) or not value.strip():
        return None
    try:
        when = datetime.fromisoformat(value.strip().replace("Z", "+00:00").replace("z", "+00:00"))
    except ValueError:
        return None
    return when if when.tzinfo is not None else when.replace(tzinfo=timezone.utc)


def maintenance_notice(value: str | None, lead_s: float, now: datetime | None = None) -> str | None:
    """The reason to stop that an ``instance/upcoming-maintenance`` answer gives, or None (see
    :func:`upcoming_maintenance`; an answer that is not JSON is none)."""
    try:
        info = json.loads(value) if value else None
    except ValueError:
        return None
    reason = upcoming_maintenance(info, lead_s, now)
    return f"{UPCOMING_MAINTENANCE}: {reason}" if reason else None


def upcoming_maintenance(info, lead_s: float, now: datetime | None = None) -> str | None:
    """What an UpcomingMaintenance object (the metadata server's answer, or a TPU node's
    ``upcomingMaintenance`` as gcloud describes it) announces now, or None: maintenance ONGOING,
    or a window starting within ``lead_s`` seconds of ``now``. A window already ended is stale,
    whatever its status. Anything else (not an object, an ``error`` object, PENDING with a start
    later than the lead time or none that parses) is no notice."""
    if not isinstance(info, dict) or "error" in info:
        return None
    status = str(info.get("maintenanceStatus", "")).strip().upper()
    kind = info.get("type", info.get("maintenanceType"))
    described = f"{kind or 'maintenance'} {status or '(no status)'}"
    start, end = _rfc3339(info.get("windowStartTime")), _rfc3339(info.get("windowEndTime"))
    now = now or datetime.now(timezone.utc)
    if end is not None and end <= now:
        return None
    if status == "ONGOING":
        return described
    if start is None:
        return None
    ahead = (start - now).total_seconds()
    if ahead > lead_s:
        return None
    when = f"in {ahead:.0f} s" if ahead > 0 else f"{-ahead:.0f} s ago"
    return f"{described}, window starts {info['windowStartTime']} ({when})"


def watch(cfg, stop) -> NoticeWatcher | None:
    """Start watching the metadata server ``cfg`` (the ``preemption`` group) names, or the real one
    on GCE; None (nothing started) otherwise."""
    if not cfg.watch_notices:
        return None
    url = cfg.metadata_url or (GCE_METADATA_URL if on_gce() else None)
    if url is None:
        return None
    watcher = NoticeWatcher(url, stop.notice, maintenance_lead_s=cfg.maintenance_lead_s)
    watcher.start()
    return watcher


class NoticeWatcher:
    """Calls ``on_notice(reason)`` (at most once per key), from daemon threads, when a key in
    :data:`KEYS` or ``instance/upcoming-maintenance`` announces a stop."""

    POLL_TIMEOUT_S = 60  # the metadata server answers a long poll at the latest after this
    RETRY_S = 5.0  # after a failed request
    # instance/upcoming-maintenance: at most this long between two looks (a plain request when the
    # key has no ETag, e.g. a 404; else a long poll that times out after this long)
    MAINTENANCE_POLL_S = 30.0

    def __init__(self, base_url: str, on_notice, maintenance_lead_s: float = 300.0):
        self.base_url, self.on_notice = base_url.rstrip("/"), on_notice
        self.maintenance_lead_s = maintenance_lead_s
        self._done = threading.Event()
        self._threads = [threading.Thread(target=self._watch, args=(key,), daemon=True,
                                          name=f"xtrain-gce-notice-{key.rsplit('/', 1)[-1]}")
                         for key in KEYS]
        self._threads.append(threading.Thread(target=self._watch_maintenance, daemon=True,
                                              name="xtrain-gce-notice-upcoming-maintenance"))

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def stop(self) -> None:
        """Stop watching (the threads end after their current request; they are daemons)."""
        self._done.set()

    def _get(self, key: str, etag: str | None,
             timeout_s: float | None = None) -> tuple[str, str | None]:
        timeout_s = self.POLL_TIMEOUT_S if timeout_s is None else timeout_s
        query = "" if etag is None else (f"?wait_for_change=true&last_etag={etag}"
                                         f"&timeout_sec={max(1, round(timeout_s))}")
        request = urllib.request.Request(f"{self.base_url}/{key}{query}",
                                         headers={"Metadata-Flavor": "Google"})
        with urllib.request.urlopen(request, timeout=timeout_s + 10) as response:
            return response.read().decode(), response.headers.get("ETag")

    def _warn(self, key: str, every_s: float) -> None:
        print(f"xtrain: warning: metadata server {self.base_url} not answering for {key}; "
              f"retrying every {every_s:.0f} s", file=sys.stderr, flush=True)

    def _watch(self, key: str) -> None:
        noticed, etag, warned = KEYS[key], None, False
        while not self._done.is_set():
            asked, asked_with = time.monotonic(), etag
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
                    self._warn(key, self.RETRY_S)
                    warned = True
                etag = None
                self._done.wait(self.RETRY_S)
                continue
            if noticed(value) and not self._done.is_set():
                self.on_notice(f"GCE notice {key}={value.strip()}")
                return
            # a server without ETags cannot long-poll, and one answering an unchanged ETag at once
            # does not hold the request: plain polling (else one core spins on requests)
            if etag is None or (etag == asked_with and time.monotonic() - asked < 1.0):
                self._done.wait(1.0)

    def _watch_maintenance(self) -> None:
        """Never ends on an error or a 404: "nothing scheduled" now says nothing about later."""
        key, etag, warned = UPCOMING_MAINTENANCE, None, False
        while not self._done.is_set():
            asked = time.monotonic()
            try:
                value, new_etag = self._get(key, etag, self.MAINTENANCE_POLL_S)
            except urllib.error.HTTPError:  # 404 or an error status: nothing scheduled (yet)
                value, new_etag = None, None
            except OSError:  # no answer at all
                if not warned:
                    self._warn(key, self.MAINTENANCE_POLL_S)
                    warned = True
                value, new_etag = None, None
            reason = maintenance_notice(value, self.maintenance_lead_s)
            if reason is not None and not self._done.is_set():
                self.on_notice(f"GCE notice {reason}")
                return
            # no ETag: no long poll, plain polling; an unchanged ETag answered at once: the server
            # does not hold the request, plain polling too (else the next request long-polls)
            held = new_etag is not None and not (
                new_etag == etag and time.monotonic() - asked < 1.0)
            etag = new_etag
            if not held:
                self._done.wait(self.MAINTENANCE_POLL_S)
