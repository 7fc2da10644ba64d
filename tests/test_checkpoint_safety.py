"""A checkpoint is untrusted input (a bucket others write to, a directory copied from elsewhere):
no file name it holds reaches outside it."""

from __future__ import annotations

import json
import os
import pickle
import re
import tempfile

import pytest
import torch

from conftest import gcs_filesystem
from xtrain.checkpoint import manifest
from xtrain.checkpoint.async_io import FsspecCheckpointIO
from xtrain.checkpoint.io import read, read_model_weights
from xtrain.errors import CheckpointError
from xtrain.inputs import newest_intact, resume_checkpoint
from xtrain.paths import url_to_fs


def _save(path: str, tensors: dict, step: int = 3) -> None:
    io = FsspecCheckpointIO(retries=0)
    io.save_checkpoint({"state_dict": tensors, "global_step": step}, path)
    assert io.wait() is not None


def _reseal(path: str) -> None:
    """Record the files as they are now in manifest.json, as whoever crafted them would."""
    fs, root = url_to_fs(path)
    recorded = json.loads(fs.cat_file(f"{root}/{manifest.MANIFEST}"))["files"]
    manifest.write(fs, root, manifest.describe(fs, root, list(recorded)))


def _point_metadata_at(path: str, name: str) -> None:
    """Every storage item of the checkpoint's DCP metadata names the data file ``name``."""
    fs, root = url_to_fs(path)
    metadata = pickle.loads(fs.cat_file(f"{root}/tensors/.metadata"))  # written by this test: trusted
    for info in metadata.storage_data.values():
        info.relative_path = name
    fs.pipe_file(f"{root}/tensors/.metadata", pickle.dumps(metadata))
    _reseal(path)


LOADS = (read, read_model_weights)  # resume, sampling and the C++ evaluation


@pytest.mark.parametrize("kind", ["relative", "absolute", "nested"])
def test_dcp_metadata_naming_a_file_outside_the_checkpoint_is_refused(tmp_path, kind):
    """DCP joins each item's relative_path to the directory it reads: without the check a local
    load returned the tensors of any file the path named (here another checkpoint's)."""
    ckpt, other = tmp_path / "run" / "step_000003", tmp_path / "other" / "step_000003"
    _save(str(ckpt), {"w": torch.ones(4)})
    _save(str(other), {"w": torch.full((4,), 7.0)})
    (target,) = (other / "tensors").glob("*.distcp")
    name = {"relative": os.path.relpath(target, ckpt / "tensors"), "absolute": str(target),
            "nested": f"sub/{target.name}"}[kind]
    _point_metadata_at(str(ckpt), name)
    for load in LOADS:
        with pytest.raises(CheckpointError, match=re.escape(
                f"checkpoint {ckpt}: tensors/.metadata names the data file '{name}', not one DCP writes")):
            load(str(ckpt))


def test_through_gcs_a_traversal_name_is_refused_before_any_download(tmp_path, gcs_bucket, monkeypatch):
    """On remote storage each data file is downloaded into a local staging directory under its
    metadata name: ``../../x`` wrote any file the user can write (the reviewer's proof of concept,
    through the emulator). Only DCP's own metadata file is fetched before the refusal."""
    bucket, _ = gcs_bucket
    url = f"{bucket}/evil/step_000003"
    _save(url, {"w": torch.ones(4)})
    fs = gcs_filesystem(bucket)
    data = fs.cat_file(f"{url}/tensors/__0_0.distcp")
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))  # staging: tmp/xtrain-ckpt-*/
    name, planted = "../../pwned", tmp_path / "pwned"
    fs.pipe_file(f"{url}/tensors/{name}", data)  # what the crafted checkpoint serves there
    _point_metadata_at(url, name)
    fetched = []
    real_get = fs.get_file  # an instance attribute (fsspec's sync wrapper); xtrain's instance too
    monkeypatch.setattr(fs, "get_file", lambda rpath, lpath, **kw: fetched.append(rpath) or real_get(rpath, lpath, **kw))
    for load in LOADS:
        with pytest.raises(CheckpointError, match=re.escape(
                f"checkpoint {url}: tensors/.metadata names the data file '{name}', not one DCP writes")):
            load(url)
    assert not planted.exists()
    assert fetched and all(p.endswith("/tensors/.metadata") for p in fetched)


@pytest.mark.parametrize("entry", ["../step_000001/state.pt", "/etc/hostname", "tensors/../../x",
                                   "tensors//.metadata", "../../dev/zero"])
def test_a_manifest_entry_outside_the_checkpoint_is_refused_unread(tmp_path, monkeypatch, entry):
    """Verifying a checkpoint reads every file its manifest lists: ``../../dev/zero`` read forever,
    any other name read a file outside the checkpoint. Refused, naming both, before any read."""
    run = tmp_path / "run"
    _save(str(run / "step_000001"), {"w": torch.ones(4)})
    ckpt = run / "step_000002"
    _save(str(ckpt), {"w": torch.ones(4)})
    recorded = json.loads((ckpt / manifest.MANIFEST).read_text())
    recorded["files"][entry] = {"size": 5, "crc32c": "AAAAAA=="}
    (ckpt / manifest.MANIFEST).write_text(json.dumps(recorded))
    monkeypatch.setattr(manifest, "describe", lambda *a: pytest.fail("a file was read"))
    refusal = re.escape(f"checkpoint {ckpt}: manifest.json lists '{entry}', not a path inside the checkpoint")
    with pytest.raises(CheckpointError, match=refusal):
        manifest.problems(str(ckpt))
    with pytest.raises(CheckpointError, match=refusal):
        resume_checkpoint(str(ckpt), str(tmp_path / "new"), gpt=None, early=True)
    with pytest.raises(CheckpointError, match=refusal):  # the run's own newest: not passed over
        newest_intact(str(run))


def test_only_the_file_names_dcp_writes_pass():
    """The names DCP's writer gives (one file per process here; torch 2.9) pass the check."""
    from xtrain.checkpoint.layout import check_dcp_files

    check_dcp_files("ckpt", ["__0_0.distcp", "__15_3.distcp"])
    for bad in ("__0_0.distcp/", ".metadata", "x__0_0.distcp", "__0_0.distcp\n", None):
        with pytest.raises(CheckpointError):
            check_dcp_files("ckpt", [bad])
