"""GCE preemption and maintenance notices (xtrain/train/notices.py).

The GCE metadata server cannot exist here, so a local HTTP server answers its notice paths the
way it documents them: ``Metadata-Flavor: Google`` required, an ``ETag`` on every answer, and
``?wait_for_change=true&last_etag=...`` held open until the value changes (or ``timeout_sec``).
``instance/upcoming-maintenance`` answers a JSON object, the documented error object when nothing
is scheduled, or (as a server might) a 404 or another HTTP error.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import threading
import time
from datetime import datetime, timedelta, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace
from urllib.parse import parse_qs, urlparse

import pytest

from conftest import TINY, read_jsonl
from test_checkpoint import finish, wait_for_step, xtrain
from xtrain.checkpoint.layout import committed_checkpoints
from xtrain.modes import run
from xtrain.observe.preemptions import ATTEMPT, stop_record
from xtrain.train import notices
from xtrain.train.preemption import StopRequest

NOTHING_SCHEDULED = '{ "error": "no notifications have been received yet, try again later" }'
PATHS = {"/computeMetadata/v1/instance/preempted": "FALSE",
         "/computeMetadata/v1/instance/maintenance-event": "NONE",
         "/computeMetadata/v1/instance/upcoming-maintenance": NOTHING_SCHEDULED}


def schedule(status="PENDING", start_in_s=7 * 24 * 3600.0, hours=4, kind="SCHEDULED") -> str:
    """An upcoming-maintenance answer, fields as the TPU docs list them."""
    start = datetime.now(timezone.utc) + timedelta(seconds=start_in_s)
    stamp = lambda t: t.strftime("%Y-%m-%dT%H:%M:%SZ")  # noqa: E731
    return json.dumps({"type": kind, "canReschedule": status == "PENDING",
                       "windowStartTime": stamp(start),
                       "latestWindowStartTime": stamp(start + timedelta(seconds=1)),
                       "windowEndTime": stamp(start + timedelta(hours=hours)),
                       "maintenanceStatus": status})


class MetadataServer:
    """The metadata server's notice paths, on 127.0.0.1. A value None answers 404; a value
    ``(code, body)`` answers that HTTP error with that body."""

    def __init__(self):
        self.values, self.requests = dict(PATHS), []
        self.holds = True  # False: long polls answered at once (an emulator or proxy may)
        self.changed = threading.Condition()
        self.on_delivery = {}  # path -> (value, hook): announce(..., delivered=hook)
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                url = urlparse(self.path)
                server.requests.append((url.path, url.query, self.headers.get("Metadata-Flavor")))
                if self.headers.get("Metadata-Flavor") != "Google":
                    return self.send_error(403)
                if server.values.get(url.path) is None:
                    return self.send_error(404)
                query = parse_qs(url.query)
                with server.changed:
                    if query.get("wait_for_change") == ["true"] and server.holds:
                        server.changed.wait_for(
                            lambda: server.etag(url.path) != query.get("last_etag", [""])[0],
                            timeout=float(query.get("timeout_sec", ["60"])[0]))
                    value = server.values[url.path]
                if value is None:
                    return self.send_error(404)
                if isinstance(value, tuple):
                    code, text = value
                    body = text.encode()
                    self.send_response(code)
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    return self.wfile.write(body)
                body = value.encode()
                self.send_response(200)
                self.send_header("ETag", server.etag(url.path))
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
                with server.changed:
                    announced, hook = server.on_delivery.get(url.path, (None, None))
                    if announced is value:
                        del server.on_delivery[url.path]
                if announced is value:
                    hook()

            def log_message(self, *args):
                pass

        class Server(ThreadingHTTPServer):
            daemon_threads = True

            def handle_error(self, request, client_address):
                # a long poll still open when its watcher went away (the test ended) writes into
                # a closed socket, up to a minute later, while another test captures stderr
                if not isinstance(sys.exc_info()[1], ConnectionError):
                    super().handle_error(request, client_address)

        self.httpd = Server(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/computeMetadata/v1"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def etag(self, path: str) -> str:
        return f"etag-{abs(hash(self.values[path]))}"

    def asked(self, key: str) -> int:
        return sum(path.endswith(f"/instance/{key}") for path, _, _ in self.requests)

    def wait_asked(self, key: str, more: int, timeout: float = 20.0) -> None:
        """Until ``more`` requests for ``key`` have come after this call."""
        target, deadline = self.asked(key) + more, time.monotonic() + timeout
        while self.asked(key) < target:
            assert time.monotonic() < deadline, f"{key} not asked again"
            time.sleep(0.02)

    def announce(self, key: str, value, delivered=None) -> None:
        """``delivered`` is called (in the server's thread) right after ``value`` is first
        answered to a watcher."""
        path = f"/computeMetadata/v1/instance/{key}"
        with self.changed:
            self.values[path] = value
            if delivered:
                self.on_delivery[path] = (value, delivered)
            self.changed.notify_all()

    def close(self):
        self.httpd.shutdown()


@pytest.fixture
def metadata_server():
    server = MetadataServer()
    yield server
    server.close()


def last_step(run_dir: Path) -> int:
    return max(r["step"] for r in read_jsonl(run_dir / "metrics.jsonl") if "loss" in r)


def announce_to_run(metadata_server, run_dir: Path, key: str, value) -> tuple[int, list]:
    """Announce ``value``; returns the last step logged before, and a list that gets the last
    step logged when the server hands the value to the run's watcher: a stop is timed from
    there, not from the announcement (the server's thread may wake late on a loaded machine)."""
    before, delivered = last_step(run_dir), []
    metadata_server.announce(key, value, delivered=lambda: delivered.append(last_step(run_dir)))
    return before, delivered


@pytest.mark.parametrize("key, value", [("preempted", "TRUE"),
                                        ("maintenance-event", "TERMINATE_ON_HOST_MAINTENANCE")])
def test_a_notice_stops_at_the_next_step_with_a_checkpoint(metadata_server, tmp_path, key, value):
    run_dir = tmp_path / "run"
    # 64 rows a step: steps long enough (~0.3 s) to tell "the next step" from "a few later"
    # with the watcher's thread kept off the cores for a while
    proc = xtrain(run_dir, "trainer.max_steps=400", "trainer.device_batch_size=64",
                  f"preemption.metadata_url={metadata_server.url}")
    wait_for_step(run_dir, 5, proc)
    before, delivered = announce_to_run(metadata_server, run_dir, key, value)
    code, out, err = finish(proc)
    assert code == 143, err[-3000:]
    stopped_at = int(re.search(r"at step (\d+): checkpoint committed", out).group(1))
    assert f"stopped (GCE notice instance/{key}={value})" in out
    # the run says why it stopped, last, where the launcher reads it (no launcher: no attempt)
    stop = read_jsonl(run_dir / "metrics.jsonl")[-1]
    assert {k: v for k, v in stop.items() if k != "time"} == {
        "step": stopped_at, "kind": "stop", "stopped_for": "notice",
        "stop_reason": f"GCE notice instance/{key}={value}"}
    # the step running when the notice came, or at worst the one after it; the one just logged
    # when it came between that step's record and its stop check (metrics come first:
    # xtrain/train/run.py Callbacks.all), as once on a loaded machine
    assert before <= stopped_at <= delivered[0] + 2, (before, delivered, stopped_at)
    assert [s for s, _ in committed_checkpoints(str(run_dir / "checkpoints"))] == [stopped_at]
    asked = {(path.rsplit("/", 1)[-1], "wait_for_change=true" in query, flavor)
             for path, query, flavor in metadata_server.requests}
    assert {("preempted", True, "Google"), ("maintenance-event", True, "Google"),
            ("upcoming-maintenance", True, "Google")} <= asked


def test_a_live_migration_notice_does_not_stop_the_run(metadata_server, tmp_path):
    run_dir = tmp_path / "run"
    proc = xtrain(run_dir, "trainer.max_steps=40", f"preemption.metadata_url={metadata_server.url}")
    wait_for_step(run_dir, 5, proc)
    metadata_server.announce("maintenance-event", "MIGRATE_ON_HOST_MAINTENANCE")
    code, out, err = finish(proc)
    assert code == 0 and "stopped" not in out, err[-3000:]
    assert last_step(run_dir) == 40


def test_a_maintenance_window_within_the_lead_time_stops_the_run_one_far_ahead_does_not(
        metadata_server, tmp_path):
    run_dir = tmp_path / "run"
    proc = xtrain(run_dir, "trainer.max_steps=400", "trainer.device_batch_size=64",
                  f"preemption.metadata_url={metadata_server.url}",
                  "preemption.maintenance_lead_s=600")
    wait_for_step(run_dir, 5, proc)
    path = "/computeMetadata/v1/instance/upcoming-maintenance"
    metadata_server.announce("upcoming-maintenance", schedule(start_in_s=7 * 24 * 3600))
    far = metadata_server.etag(path)
    # the watcher read the week-ahead window (its next long poll carries that answer's ETag) and
    # the run goes on
    deadline = time.monotonic() + 20
    while not any(p == path and f"last_etag={far}" in q for p, q, _ in metadata_server.requests):
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.02)
    assert proc.poll() is None
    # within the configured lead time (600 s), beyond the default one (300 s)
    before, delivered = announce_to_run(metadata_server, run_dir, "upcoming-maintenance",
                                        schedule(start_in_s=400))
    code, out, err = finish(proc)
    assert code == 143, err[-3000:]
    stopped_at = int(re.search(r"at step (\d+): checkpoint committed", out).group(1))
    assert ("stopped (GCE notice instance/upcoming-maintenance: SCHEDULED PENDING, window starts "
            in out), out[-3000:]
    assert before <= stopped_at <= delivered[0] + 2, (before, delivered, stopped_at)  # (as above)
    assert [s for s, _ in committed_checkpoints(str(run_dir / "checkpoints"))] == [stopped_at]


def wait_for(reasons: list, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not reasons:
        assert time.monotonic() < deadline, "no notice"
        time.sleep(0.02)


def test_a_stop_is_the_vms_when_a_notice_asked_for_it_whatever_came_first():
    """What xtrain/train/run.py records for the launcher: a GCE notice's stop (the fleet re-runs
    it), not a signal's (the fleet re-runs it only if the VM goes down)."""
    def stopped(*requests):
        stop = StopRequest()
        stop.install()
        try:
            assert not stop.agreed() and stop.stopped_for is None
            for request in requests:
                request(stop)
            return stop.agreed(), stop.stopped_for, stop.reason
        finally:
            stop.uninstall()

    def sigterm(stop):
        os.kill(os.getpid(), signal.SIGTERM)  # through the handler the run installs

    def notice(stop):
        stop.notice("GCE notice instance/preempted=TRUE")

    assert stopped(sigterm) == (True, "signal", "SIGTERM")
    assert stopped(sigterm, sigterm) == (True, "signal", "SIGTERM")
    assert stopped(notice) == (True, "notice", "GCE notice instance/preempted=TRUE")
    assert stopped(sigterm, notice) == (True, "notice", "GCE notice instance/preempted=TRUE")
    assert stopped(notice, sigterm) == (True, "notice", "GCE notice instance/preempted=TRUE")
    assert stop_record("notice", "GCE notice x", {ATTEMPT: "20250101-a1"}) == {
        "stopped_for": "notice", "stop_reason": "GCE notice x", "attempt": "20250101-a1"}
    # another process was told (its reason stays there); run by hand: no attempt
    assert stop_record("signal", None, {}) == {"stopped_for": "signal"}


def test_a_server_that_answers_long_polls_at_once_is_polled_once_a_second(metadata_server):
    """A server that answers a long poll at once with the same ETag does not hold requests: the
    watcher polls it plainly instead of asking again at once (some 800 requests a second per
    key, a core busy on every host of a run)."""
    metadata_server.holds = False
    watcher = notices.NoticeWatcher(metadata_server.url, lambda reason: None)
    watcher.start()
    try:
        time.sleep(3)
    finally:
        watcher.stop()
    for key in ("preempted", "maintenance-event", "upcoming-maintenance"):
        assert 1 <= metadata_server.asked(key) <= 6, (key, metadata_server.asked(key))


def test_nothing_scheduled_then_a_schedule_is_still_noticed(metadata_server, monkeypatch):
    """404s, error statuses and bodies that say nothing is scheduled do not end the watch."""
    monkeypatch.setattr(notices.NoticeWatcher, "MAINTENANCE_POLL_S", 0.2)
    key = "upcoming-maintenance"
    metadata_server.announce(key, None)  # 404
    reasons = []
    watcher = notices.NoticeWatcher(metadata_server.url, reasons.append)
    watcher.start()
    try:
        for answer in [None, (503, "unavailable"), (500, NOTHING_SCHEDULED), NOTHING_SCHEDULED,
                       "<html>not JSON</html>", "", "[]", schedule(start_in_s=7 * 24 * 3600)]:
            metadata_server.announce(key, answer)
            metadata_server.wait_asked(key, 2)  # the second one: the first answer was taken in
            assert reasons == [], answer
        metadata_server.announce(key, schedule("ONGOING", start_in_s=-60))
        wait_for(reasons)
        assert reasons == ["GCE notice instance/upcoming-maintenance: SCHEDULED ONGOING"]
    finally:
        watcher.stop()


def test_a_pending_window_becomes_a_notice_as_its_start_nears(metadata_server, monkeypatch):
    """The answer does not change: the clock does (the long poll times out, the start is checked
    again)."""
    monkeypatch.setattr(notices.NoticeWatcher, "MAINTENANCE_POLL_S", 0.2)
    metadata_server.announce("upcoming-maintenance", schedule(start_in_s=6, kind="UNSCHEDULED"))
    reasons = []
    watcher = notices.NoticeWatcher(metadata_server.url, reasons.append, maintenance_lead_s=3)
    watcher.start()
    try:
        metadata_server.wait_asked("upcoming-maintenance", 2)
        assert reasons == []  # 5 to 6 s ahead, more than 3
        wait_for(reasons)
        assert reasons[0].startswith("GCE notice instance/upcoming-maintenance: UNSCHEDULED "
                                     "PENDING, window starts ")
    finally:
        watcher.stop()


NOW = datetime(2024, 11, 8, 4, 0, tzinfo=timezone.utc)


def window(status="PENDING", start="2024-11-15T04:00:00Z", end="2024-11-15T08:00:00Z", **more):
    fields = {"type": "SCHEDULED", "canReschedule": True, "windowStartTime": start,
              "latestWindowStartTime": start, "windowEndTime": end, "maintenanceStatus": status}
    fields.update(more)
    return json.dumps({k: v for k, v in fields.items() if v is not None})


@pytest.mark.parametrize("answer, notice", [
    ("", False), ("   ", False), ("not JSON", False), ("[]", False), ("null", False),
    ('"ONGOING"', False), (NOTHING_SCHEDULED, False),
    ('{"error": "x", "maintenanceStatus": "ONGOING"}', False),  # an error object is never a notice
    (window(), False),  # a week ahead
    (window(start="2024-11-08T04:04:59Z"), True),  # 299 s ahead, lead 300 s
    (window(start="2024-11-08T04:05:00Z"), True),  # exactly the lead time
    (window(start="2024-11-08T04:05:01Z"), False),
    (window(start="2024-11-08T04:04:00.123456789Z"), True),  # nanoseconds, as RFC 3339 allows
    (window(start="2024-11-08T06:04:00+02:00"), True),  # an offset: 04:04 UTC
    (window(start="2024-11-08T03:59:00Z", end="2024-11-08T08:00:00Z"), True),  # open, not ONGOING
    (window(start="2024-11-07T23:00:00Z", end="2024-11-08T03:00:00Z"), False),  # ended: stale
    (window(start="soon"), False), (window(start=None), False), (window(start=7), False),
    (window("ONGOING"), True), (window("ongoing", start=None, end=None), True),
    (window("ONGOING", start="2024-11-07T23:00:00Z", end="2024-11-08T03:00:00Z"), False),  # stale
    (window("UNKNOWN"), False),
    (window(type=None, maintenanceType="UNSCHEDULED", start="2024-11-08T04:01:00Z"), True),
])
def test_an_upcoming_maintenance_answer_is_a_notice_when_ongoing_or_within_the_lead(answer, notice):
    reason = notices.maintenance_notice(answer, 300, now=NOW)
    assert (reason is not None) is notice, reason
    if notice:
        assert reason.startswith("instance/upcoming-maintenance: ")


@pytest.mark.parametrize("product, gce", [("Google Compute Engine\n", True),
                                           ("Standard PC (Q35 + ICH9, 2009)\n", False),
                                           (None, False)])
def test_a_gce_vm_is_known_by_its_dmi_product_name(tmp_path, monkeypatch, product, gce):
    dmi = tmp_path / "product_name"
    if product is not None:  # None: no DMI at all (a container)
        dmi.write_text(product)
    monkeypatch.setattr(notices, "_DMI_PRODUCT", dmi)
    assert notices.on_gce() is gce


def test_on_gce_the_vms_own_metadata_server_is_watched_unless_turned_off(
        metadata_server, compose_config, tmp_path, monkeypatch):
    """No metadata_url set: on GCE (by its DMI name) the watcher asks the VM's metadata server.
    That server exists only on GCE: its address is pointed at the stand-in here."""
    dmi = tmp_path / "product_name"
    dmi.write_text("Google Compute Engine\n")
    monkeypatch.setattr(notices, "_DMI_PRODUCT", dmi)
    monkeypatch.setattr(notices, "GCE_METADATA_URL", metadata_server.url)
    cfg = compose_config(TINY).preemption
    assert not cfg.metadata_url
    assert notices.watch(compose_config(TINY + ["preemption.watch_notices=false"]).preemption,
                         SimpleNamespace(notice=print)) is None
    told = threading.Event()
    watcher = notices.watch(cfg, SimpleNamespace(notice=lambda reason: told.set()))
    try:
        metadata_server.announce("preempted", "TRUE")
        assert told.wait(30), "the notice on the VM's metadata server was not seen"
    finally:
        watcher.stop()


def test_off_gce_no_watcher_thread_runs(compose_config, tmp_path, monkeypatch):
    # the DMI file of a machine off GCE, whatever machine runs the test
    dmi = tmp_path / "product_name"
    dmi.write_text("Standard PC (Q35 + ICH9, 2009)\n")
    monkeypatch.setattr(notices, "_DMI_PRODUCT", dmi)
    import lightning as L

    import xtrain.train.run as run_module

    seen = []
    earlier = set(threading.enumerate())  # an earlier test's watcher may still finish its poll

    class Threads(L.Callback):
        def on_train_batch_end(self, *args):
            seen.extend(t.name for t in threading.enumerate() if t not in earlier)

    all_callbacks = run_module.Callbacks.all
    monkeypatch.setattr(run_module.Callbacks, "all", lambda self, s: all_callbacks(self, s) + [Threads()])
    cfg = compose_config(TINY + ["trainer.max_steps=3"], output_dir=str(tmp_path))
    run(cfg, str(tmp_path))
    assert seen and "xtrain-loader" in seen  # the observer saw the run's threads
    assert not [name for name in seen if name.startswith("xtrain-gce-notice")]

