"""GCE preemption and maintenance notices (xtrain/train/notices.py).

The GCE metadata server cannot exist here, so a local HTTP server answers its two paths the way
it documents them: ``Metadata-Flavor: Google`` required, an ``ETag`` on every answer, and
``?wait_for_change=true&last_etag=...`` held open until the value changes (or ``timeout_sec``).
"""

from __future__ import annotations

import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlparse

import pytest

from conftest import TINY
from test_checkpoint import finish, wait_for_step, xtrain
from xtrain.checkpoint.layout import committed_checkpoints
from xtrain.modes import run
from xtrain.train import notices

PATHS = {"/computeMetadata/v1/instance/preempted": "FALSE",
         "/computeMetadata/v1/instance/maintenance-event": "NONE"}


class MetadataServer:
    """The metadata server's two notice paths, on 127.0.0.1."""

    def __init__(self):
        self.values, self.requests = dict(PATHS), []
        self.changed = threading.Condition()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                url = urlparse(self.path)
                server.requests.append((url.path, url.query, self.headers.get("Metadata-Flavor")))
                if self.headers.get("Metadata-Flavor") != "Google":
                    return self.send_error(403)
                if url.path not in server.values:
                    return self.send_error(404)
                query = parse_qs(url.query)
                with server.changed:
                    if query.get("wait_for_change") == ["true"]:
                        server.changed.wait_for(
                            lambda: server.etag(url.path) != query.get("last_etag", [""])[0],
                            timeout=float(query.get("timeout_sec", ["60"])[0]))
                    value = server.values[url.path]
                body = value.encode()
                self.send_response(200)
                self.send_header("ETag", server.etag(url.path))
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/computeMetadata/v1"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def etag(self, path: str) -> str:
        return f"etag-{abs(hash(self.values[path]))}"

    def announce(self, key: str, value: str) -> None:
        with self.changed:
            self.values[f"/computeMetadata/v1/instance/{key}"] = value
            self.changed.notify_all()

    def close(self):
        self.httpd.shutdown()


@pytest.fixture
def metadata_server():
    server = MetadataServer()
    yield server
    server.close()


def last_step(run_dir: Path) -> int:
    from conftest import read_jsonl

    return max(r["step"] for r in read_jsonl(run_dir / "metrics.jsonl") if "loss" in r)


@pytest.mark.parametrize("key, value", [("preempted", "TRUE"),
                                        ("maintenance-event", "TERMINATE_ON_HOST_MAINTENANCE")])
def test_a_notice_stops_at_the_next_step_with_a_checkpoint(metadata_server, tmp_path, key, value):
    run_dir = tmp_path / "run"
    # 16 rows a step: steps long enough (~0.1 s) to tell "the next step" from "a few later"
    proc = xtrain(run_dir, "trainer.max_steps=400", "trainer.device_batch_size=16",
                  f"preemption.metadata_url={metadata_server.url}")
    wait_for_step(run_dir, 5, proc)
    noticed_after = last_step(run_dir)
    metadata_server.announce(key, value)
    code, out, err = finish(proc)
    assert code == 143, err[-3000:]
    stopped_at = int(re.search(r"at step (\d+): checkpoint committed", out).group(1))
    assert f"stopped (GCE notice instance/{key}={value})" in out
    # the step running when the notice came, or at worst the one after it
    assert noticed_after < stopped_at <= noticed_after + 2, (noticed_after, stopped_at)
    assert [s for s, _ in committed_checkpoints(str(run_dir / "checkpoints"))] == [stopped_at]
    asked = {(path.rsplit("/", 1)[-1], "wait_for_change=true" in query, flavor)
             for path, query, flavor in metadata_server.requests}
    assert {("preempted", True, "Google"), ("maintenance-event", True, "Google")} <= asked


def test_a_live_migration_notice_does_not_stop_the_run(metadata_server, tmp_path):
    run_dir = tmp_path / "run"
    proc = xtrain(run_dir, "trainer.max_steps=40", f"preemption.metadata_url={metadata_server.url}")
    wait_for_step(run_dir, 5, proc)
    metadata_server.announce("maintenance-event", "MIGRATE_ON_HOST_MAINTENANCE")
    code, out, err = finish(proc)
    assert code == 0 and "stopped" not in out, err[-3000:]
    assert last_step(run_dir) == 40


@pytest.mark.parametrize("product, gce", [("Google Compute Engine\n", True),
                                           ("Standard PC (Q35 + ICH9, 2009)\n", False),
                                           (None, False)])
def test_a_gce_vm_is_known_by_its_dmi_product_name(tmp_path, monkeypatch, product, gce):
    dmi = tmp_path / "product_name"
    if product is not None:  # None: no DMI at all (a container)
        dmi.write_text(product)
    monkeypatch.setattr(notices, "_DMI_PRODUCT", dmi)
    assert notices.on_gce() is gce


def test_off_gce_no_watcher_thread_runs(compose_config, tmp_path, monkeypatch):
    # the DMI file of a machine off GCE, whatever machine runs the test
    dmi = tmp_path / "product_name"
    dmi.write_text("Standard PC (Q35 + ICH9, 2009)\n")
    monkeypatch.setattr(notices, "_DMI_PRODUCT", dmi)
    import lightning as L

    import xtrain.train.run as run_module

    seen = []

    class Threads(L.Callback):
        def on_train_batch_end(self, *args):
            seen.extend(t.name for t in threading.enumerate())

    all_callbacks = run_module.Callbacks.all
    monkeypatch.setattr(run_module.Callbacks, "all", lambda self, s: all_callbacks(self, s) + [Threads()])
    cfg = compose_config(TINY + ["trainer.max_steps=3"], output_dir=str(tmp_path))
    run(cfg, str(tmp_path))
    assert seen and "xtrain-loader" in seen  # the observer saw the run's threads
    assert not [name for name in seen if name.startswith("xtrain-gce-notice")]

