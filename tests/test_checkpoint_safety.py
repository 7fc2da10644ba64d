"""A checkpoint is untrusted input (a bucket others write to, a directory copied from elsewhere):
no file name it holds reaches outside it, a crafted pickle is refused in one line before anything
is built, and no committed checkpoint is ever deleted by a resume or a save, only renamed aside."""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
import socket
import tempfile
import time
from pathlib import Path

import pytest
import torch

from conftest import assert_same_tensors, checkpoint_tensors, finish, gcs_filesystem, xtrain
from xtrain.checkpoint import manifest
from xtrain.checkpoint.async_io import FsspecCheckpointIO
from xtrain.checkpoint.io import check_loadable, read, read_model_weights
from xtrain.checkpoint.layout import committed_checkpoints, set_aside, step_dirs
from xtrain.errors import EXIT_REFUSED, CheckpointError
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


class _Payload:
    """Unpickling this runs ``touch <marker>``: what a crafted checkpoint would carry."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


LOADS = (read, read_model_weights, check_loadable)  # resume, sampling/C++ eval, the early check


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


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A finished tiny run (checkpoints at steps 2 and 4), run a second time unchanged."""
    run = tmp_path_factory.mktemp("world") / "run"
    code, _, err = finish(xtrain(run, "trainer.max_steps=4", "checkpoint.every=2"))
    assert code == 0, err[-3000:]
    inode = (run / "checkpoints" / "step_000004" / "state.pt").stat().st_ino
    code, out, err = finish(xtrain(run, "trainer.max_steps=4", "checkpoint.every=2"))
    assert code == 0 and "resuming from" in out, err[-3000:]
    return {"run": run, "rerun_err": err, "inode": inode}


def test_a_finished_run_run_again_leaves_its_checkpoints_as_they_are(world):
    """Nothing is trained (Lightning skips a fit loop already at max_steps), so nothing is saved:
    the newest checkpoint is neither written again nor renamed aside."""
    ckpts = world["run"] / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_000002", "step_000004"]
    assert (ckpts / "step_000004" / "state.pt").stat().st_ino == world["inode"]
    assert "warning" not in world["rerun_err"]


def _tree(root: Path) -> dict:
    return {str(p): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("mode, crafted", [("train", ".metadata"), ("train", "state.pt"),
                                           ("sample", ".metadata"), ("sample", "state.pt")])
def test_a_crafted_checkpoint_is_refused_in_one_line_before_anything_is_built(world, tmp_path, mode, crafted):
    """Pickled code in DCP's metadata or in state.pt, its manifest made to match: exit 2, one line
    naming the checkpoint, no code run, no model built, nothing written."""
    ckpt, marker = tmp_path / "crafted" / "step_000004", tmp_path / "code-ran"
    shutil.copytree(world["run"] / "checkpoints" / "step_000004", ckpt)
    if crafted == ".metadata":
        (ckpt / "tensors" / ".metadata").write_bytes(pickle.dumps(_Payload(marker)))
    else:
        torch.save({"global_step": 4, "x": _Payload(marker)}, ckpt / "state.pt")
    _reseal(str(ckpt))
    before = _tree(tmp_path / "crafted")
    started = time.perf_counter()
    code, out, err = finish(xtrain(tmp_path / "run", f"mode={mode}", "trainer.max_steps=6",
                                   f"checkpoint.resume={ckpt}"))
    seconds = time.perf_counter() - started
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == EXIT_REFUSED, err[-3000:]
    assert len(lines) == 1 and lines[0].startswith(f"xtrain: checkpoint error: checkpoint {ckpt}: "
                                                   f"{'tensors/' if crafted == '.metadata' else 'state.pt'} refused (")
    assert "posix.system" in lines[0] and "weights_only" not in lines[0]
    assert not marker.exists() and _tree(tmp_path / "crafted") == before
    assert "MFU peak" not in out and "sampling" not in out  # built nothing: refused up front
    assert not (tmp_path / "run" / "checkpoints").exists()
    assert seconds < 20, f"refused after {seconds:.1f} s"


def test_a_tensor_file_that_is_no_zip_is_refused_in_one_line(world, tmp_path):
    """A data file's first bytes damaged (or crafted), its manifest made to match: DCP's reader
    fails inside torch.load, and DCP wraps that in a CheckpointException (a BaseException), which
    ended the command with a traceback (exit 1)."""
    ckpt = tmp_path / "damaged" / "step_000004"
    shutil.copytree(world["run"] / "checkpoints" / "step_000004", ckpt)
    data = ckpt / "tensors" / "__0_0.distcp"
    data.write_bytes(b"XXXX" + data.read_bytes()[4:])  # (a zip starts with PK\x03\x04)
    _reseal(str(ckpt))
    code, _, err = finish(xtrain(tmp_path / "run", "mode=sample", "sample.max_tokens=8",
                                f"checkpoint.resume={ckpt}"))
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == EXIT_REFUSED and "Traceback" not in err, err[-3000:]
    assert lines[-1].startswith(f"xtrain: checkpoint error: checkpoint {ckpt}: tensors/ refused ("), err[-3000:]


def _meta_with_step_text(ckpt: Path) -> None:
    meta = json.loads((ckpt / "meta.json").read_text())
    (ckpt / "meta.json").write_text(json.dumps({**meta, "step": "4"}))


def _state_without_optimizer(ckpt: Path) -> None:
    state = torch.load(ckpt / "state.pt", weights_only=True)
    del state["optimizer_states"]
    torch.save(state, ckpt / "state.pt")


def _position_with_cursor_text(ckpt: Path) -> None:
    state = torch.load(ckpt / "state.pt", weights_only=True)
    state["callbacks"]["LoaderState"]["loader"]["cursor"] = "12"
    torch.save(state, ckpt / "state.pt")


def _meta_model(**changes):
    """A crafter of meta.json's saved model config: ``changes`` set (None: the field removed)."""
    def craft(ckpt: Path) -> None:
        meta = json.loads((ckpt / "meta.json").read_text())
        model = meta["config"]["model"]
        for key, value in changes.items():
            model.pop(key) if value is None else model.__setitem__(key, value)
        (ckpt / "meta.json").write_text(json.dumps(meta))
    return craft


# files of another program or another layout, each in a form every check before passed
OTHER_LAYOUTS = {
    "meta.json depth text": (_meta_model(depth="x"), "meta.json's model makes no network ("),
    "meta.json depth negative": (_meta_model(depth=-1), "meta.json's model makes no network (model.depth=-1"),
    "meta.json no head_dim": (_meta_model(head_dim=None), "meta.json's model makes no network ("),
    "meta.json a list": (lambda ckpt: (ckpt / "meta.json").write_text("[]"),
                         "unreadable meta.json (ValueError: meta.json holds a list, not a dict)"),
    "meta.json step text": (_meta_with_step_text, "meta.json holds no 'step' of the type xtrain writes"),
    "state.pt a list": (lambda ckpt: torch.save([4], ckpt / "state.pt"),
                        "state.pt holds a list, not a dict: not a training state xtrain saved"),
    "state.pt no optimizer": (_state_without_optimizer, "state.pt holds no 'optimizer_states' of "
                              "the type xtrain writes: not a training state xtrain saved"),
    "data position cursor text": (_position_with_cursor_text, "state.pt's data position holds no "
                                  "'cursor' of the type xtrain writes: not a training state"),
}


@pytest.mark.parametrize("how", ["found", "named"])
@pytest.mark.parametrize("layout", list(OTHER_LAYOUTS))
def test_a_checkpoint_of_another_layout_is_refused_in_one_line_naming_what_it_lacks(world, tmp_path,
                                                                                     layout, how):
    """A meta.json or state.pt that is not what xtrain writes, its manifest made to match, failed
    with a traceback from wherever it was first read (a resume's step, the data position's check,
    Lightning's restore). Refused in one line naming the file and what it lacks, before any
    tensor is read: found as a run's newest checkpoint or named by checkpoint.resume."""
    craft, said = OTHER_LAYOUTS[layout]
    run = tmp_path / "run"
    shutil.copytree(world["run"], run)
    ckpt = run / "checkpoints" / "step_000004"
    craft(ckpt)
    _reseal(str(ckpt))
    if how == "named":  # by a new run
        code, out, err = finish(xtrain(tmp_path / "new", "trainer.max_steps=6",
                                       f"checkpoint.resume={ckpt}"))
    else:
        code, out, err = finish(xtrain(run, "trainer.max_steps=6"))
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == EXIT_REFUSED, err[-3000:]
    assert len(lines) == 1 and str(ckpt) in lines[0] and said in lines[0], lines
    assert "MFU peak" not in out


def test_a_meta_json_model_that_makes_no_network_is_refused_by_sample_naming_the_checkpoint(world, tmp_path):
    """mode=sample builds the checkpoint's model, not the command's: a depth of text ended in a
    TypeError's traceback; one out of range was refused as if the command's model.depth were."""
    ckpt = tmp_path / "crafted" / "step_000004"
    shutil.copytree(world["run"] / "checkpoints" / "step_000004", ckpt)
    for depth, said in (("x", "TypeError"), (-1, "model.depth=-1: must be >= 1")):
        _meta_model(depth=depth)(ckpt)
        _reseal(str(ckpt))
        code, _, err = finish(xtrain(tmp_path / "run", "mode=sample", "sample.max_tokens=8",
                                     f"checkpoint.resume={ckpt}"))
        lines = [line for line in err.splitlines() if line.strip()]
        assert code == EXIT_REFUSED and len(lines) == 1, err[-3000:]
        assert lines[0].startswith(f"xtrain: checkpoint error: {ckpt}: meta.json's model makes no network ("), lines
        assert said in lines[0] or depth == "x", lines


@pytest.mark.parametrize("mode", ["train", "sample"])
def test_an_interpolation_in_meta_json_is_text_never_resolved(world, tmp_path, mode):
    """meta.json's config decides the model and the tokenizer a checkpoint is read with: an
    ``${oc.env:...}`` there would put a secret of this environment into a path or an error
    message. It is read as the text it is (here an unknown window pattern: refused in one line
    naming it), the variable's value nowhere in the output."""
    ckpt, secret = tmp_path / "crafted" / "step_000004", "s3cr3t-" + os.urandom(6).hex()
    shutil.copytree(world["run"] / "checkpoints" / "step_000004", ckpt)
    meta = json.loads((ckpt / "meta.json").read_text())
    meta["config"]["model"]["window_pattern"] = "${oc.env:XTRAIN_TEST_SECRET}"
    (ckpt / "meta.json").write_text(json.dumps(meta))
    _reseal(str(ckpt))
    code, out, err = finish(xtrain(tmp_path / "run", f"mode={mode}", "trainer.max_steps=6",
                                   "sample.max_tokens=8", f"checkpoint.resume={ckpt}",
                                   env={"XTRAIN_TEST_SECRET": secret}))
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == EXIT_REFUSED, err[-3000:]
    assert len(lines) == 1 and "${oc.env:XTRAIN_TEST_SECRET}" in lines[0], lines
    assert secret not in out + err


def _with_config(world, tmp_path, group: str = "data", **values) -> Path:
    """A copy of the run's newest checkpoint whose meta.json's config ``group`` holds ``values``."""
    ckpt = tmp_path / "crafted" / "step_000004"
    shutil.copytree(world["run"] / "checkpoints" / "step_000004", ckpt)
    meta = json.loads((ckpt / "meta.json").read_text())
    meta["config"][group].update(values)
    (ckpt / "meta.json").write_text(json.dumps(meta))
    _reseal(str(ckpt))
    return ckpt


def _trained_tokenizer(world) -> Path:
    meta = json.loads((world["run"] / "checkpoints" / "step_000004" / "meta.json").read_text())
    return Path(meta["config"]["data"]["tokenizer"])


@pytest.mark.parametrize("mode", ["sample", "eval"])
def test_sample_and_eval_refuse_a_tokenizer_the_checkpoint_was_not_trained_with(world, tmp_path, mode):
    """Same size, two token ids swapped, where the checkpoint's config says its tokenizer is: the
    model's ids would be decoded as other text without a word."""
    tok = tmp_path / "tok"
    shutil.copytree(_trained_tokenizer(world), tok)
    spec = json.loads((tok / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[300:302]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (tok / "tokenizer.json").write_text(json.dumps(spec))
    ckpt = _with_config(world, tmp_path, tokenizer=str(tok))
    code, out, err = finish(xtrain(tmp_path / "run", f"mode={mode}", f"checkpoint.resume={ckpt}",
                                   f"data.tokenizer={tok}", "sample.max_tokens=4"))
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == EXIT_REFUSED, err[-3000:]
    assert len(lines) == 1 and re.fullmatch(
        rf"xtrain: checkpoint error: {ckpt} was trained with the tokenizer of {tok} \(sha256 \w+\), "
        rf"not with the one in {tok} \(sha256 \w+\): its token ids mean other text; add "
        rf"data.tokenizer=<a copy of the tokenizer it was trained with> checkpoint.resume={ckpt}",
        lines[0]), lines
    assert "sampling" not in out and "evaluating" not in out


def test_sample_builds_no_corpus_where_a_checkpoint_says_and_reads_a_copy_of_its_tokenizer(
        world, tmp_path):
    """A read-only command must not write into the shared corpus cache, nor where a checkpoint's
    meta.json (untrusted) chooses: a tokenizer not there is refused, saying how to get it; a copy
    given as data.tokenizer is read once its sha256 is the checkpoint's."""
    elsewhere = tmp_path / "elsewhere"
    ckpt = _with_config(world, tmp_path, build_dir=str(elsewhere), tokenizer=f"{elsewhere}/tokenizer")
    args = [f"checkpoint.resume={ckpt}", "mode=sample", "sample.max_tokens=4"]
    code, out, err = finish(xtrain(tmp_path / "run", *args, f"data.tokenizer={elsewhere}/tokenizer"))
    assert code == EXIT_REFUSED, err[-3000:]
    assert err.strip() == (
        f"xtrain: data error: {ckpt} was trained with the tokenizer of {elsewhere}/tokenizer, and "
        f"{elsewhere}/tokenizer holds no tokenizer (mode=sample and mode=eval build no corpus): "
        "run the training command of that checkpoint once on this machine (it builds the corpus "
        f"and its tokenizer), or add data.tokenizer=<a copy of that tokenizer> "
        f"checkpoint.resume={ckpt}")  # (what the command below does)
    assert not elsewhere.exists() and "sampling" not in out
    meta = json.loads((ckpt / "meta.json").read_text())  # a corpus its training did not build
    meta["config"]["data"]["build_sources"] = []
    (ckpt / "meta.json").write_text(json.dumps(meta))
    _reseal(str(ckpt))
    code, out, err = finish(xtrain(tmp_path / "run", *args, f"data.tokenizer={elsewhere}/tokenizer"))
    assert code == EXIT_REFUSED and "build no corpus): copy it there (its training read a corpus " \
        "made beforehand, e.g. by python -m xtrain.data build), or add data.tokenizer=" in err, err
    copy = tmp_path / "copy"
    shutil.copytree(_trained_tokenizer(world), copy)
    code, out, err = finish(xtrain(tmp_path / "run", *args, f"data.tokenizer={copy}"))
    assert code == 0 and f"sampling {ckpt}" in out, err[-3000:]
    assert not elsewhere.exists()


def test_sample_refuses_a_checkpoint_whose_meta_json_describes_another_model(world, tmp_path):
    """meta.json decides the model its tensors are loaded into: one that disagrees with them (a
    larger vocabulary here) is refused naming the checkpoint and the first tensor that does not
    fit (it was load_state_dict's traceback)."""
    ckpt = _with_config(world, tmp_path, "model", vocab_size=5000)
    code, out, err = finish(xtrain(tmp_path / "run", "mode=sample", f"checkpoint.resume={ckpt}",
                                   "sample.max_tokens=4"))
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == EXIT_REFUSED, err[-3000:]
    assert len(lines) == 1 and lines[0].startswith(
        f"xtrain: checkpoint error: checkpoint {ckpt}: its tensors do not fit the model its "
        "meta.json describes (size mismatch for wte.weight: copying a param with shape (4096, "), lines
    assert "sampling" not in out


def test_resuming_behind_the_runs_own_commits_is_refused_unless_rewound(world, tmp_path):
    """checkpoint.* overrides keep the run's name and so its directory: resuming step 2 there
    trained on over step 4, and the save at step 4 deleted the committed one. Refused up front
    (naming it and the ways out); with checkpoint.rewind=true the newer one is renamed aside,
    once: run again, the command continues the rewound run's own work."""
    run = tmp_path / "run"
    shutil.copytree(world["run"], run)
    ckpts = run / "checkpoints"
    before = _tree(ckpts)
    original = checkpoint_tensors(ckpts / "step_000004")
    resume = [f"checkpoint.resume={ckpts}/step_000002", "trainer.max_steps=6", "checkpoint.every=2"]
    started = time.perf_counter()
    code, out, err = finish(xtrain(run, *resume))
    assert code == EXIT_REFUSED, err[-3000:]
    assert err.strip() == (
        f"xtrain: checkpoint error: checkpoint.resume={ckpts}/step_000002 is older than the "
        f"committed checkpoints in {ckpts} (step_000004), which this run would replace as it "
        "reached their steps: continue from the newest (without checkpoint.resume), train this "
        "branch elsewhere (run.name=... or checkpoint.dir=...), delete them, or set "
        "checkpoint.rewind=true (they are then renamed aside, kept)")
    assert time.perf_counter() - started < 20 and "MFU peak" not in out
    assert _tree(ckpts) == before

    code, out, err = finish(xtrain(run, *resume, "checkpoint.rewind=true"))
    assert code == 0, err[-3000:]
    (aside,) = ckpts.glob("step_000004.rewound-*")
    assert f"xtrain: warning: checkpoint {ckpts}/step_000004 (newer than the step checkpoint.rewind " \
           f"resumes from) renamed aside to {aside}: kept for inspection, not deleted" in err
    assert_same_tensors(checkpoint_tensors(aside), original)  # whole, as it was
    assert [s for s, _ in committed_checkpoints(str(ckpts))] == [4, 6]  # the rewound run's own
    # the same command again (a re-run after a stop) continues the rewound run's work
    code, out, err = finish(xtrain(run, resume[0], "trainer.max_steps=8", "checkpoint.every=2",
                                   "checkpoint.rewind=true"))
    assert code == 0 and f"resuming from {ckpts}/step_000006" in out, err[-3000:]
    assert len(list(ckpts.glob("step_*.rewound-*"))) == 1 and "renamed aside" not in err
    assert f"xtrain: warning: checkpoint.rewind=true: {ckpts} already holds this command's own " \
           "work since" in err


def test_a_retried_save_whose_first_attempt_committed_keeps_that_commit(tmp_path, monkeypatch):
    """The first attempt commits, then its storage call fails (a write that timed out after the
    object was stored), and every later write fails too: the retry finds its own save's commit
    and keeps it. Before, the retry moved it aside first and, failing, left the step with no
    commit (a first checkpoint lost: the next start trained from step 0)."""
    from xtrain.checkpoint import io as ckpt_io
    from xtrain.checkpoint.layout import latest_checkpoint

    real_commit, calls = ckpt_io.commit, []

    def flaky_commit(fs, root, written):
        calls.append(root)
        if len(calls) == 1:
            real_commit(fs, root, written)
            raise TimeoutError("the marker was stored, its answer timed out")
        raise OSError("the storage fails from now on")

    monkeypatch.setattr(ckpt_io, "commit", flaky_commit)
    ckpt = tmp_path / "step_000003"
    io = FsspecCheckpointIO(retries=1, backoff_s=0)
    io.save_checkpoint({"state_dict": {"w": torch.ones(4)}, "global_step": 3}, str(ckpt))
    assert io.wait() is not None  # saved: its first attempt's commit stands
    assert latest_checkpoint(str(tmp_path)) == str(ckpt) and len(calls) == 1
    assert [p.name for p in tmp_path.iterdir()] == ["step_000003"]  # nothing moved aside
    assert read(str(ckpt))["state_dict"]["w"].tolist() == [1.0] * 4


def _host_retrying_a_committed_save(rank: int, world: int, init: str, root: str) -> None:
    """One process of test_every_process_of_a_retried_save_keeps_its_first_attempts_commit."""
    import torch.distributed as dist

    from xtrain.checkpoint import io as ckpt_io

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    meta = {"step": 2, "saved_at": 1234.5}  # one save's, its two attempts
    for _ in range(2):  # the second: a retry after an attempt that committed, then failed
        ckpt_io.write(f"{root}/step_000002", {f"host{rank}/w": torch.ones(4)}, b"", meta,
                      rank=rank, process_group=dist.group.WORLD)
    dist.destroy_process_group()


def test_every_process_of_a_retried_save_keeps_its_first_attempts_commit(tmp_path):
    """Two gloo processes: the first host finds its save's commit, and both return (one verdict;
    a lone return would leave the other at the save's next collective)."""
    import torch.multiprocessing as mp

    mp.spawn(_host_retrying_a_committed_save, nprocs=2,
             args=(2, f"file://{tmp_path}/rendezvous", str(tmp_path / "ckpt")))
    assert [p.name for p in (tmp_path / "ckpt").iterdir()] == ["step_000002"]  # none moved aside
    assert committed_checkpoints(str(tmp_path / "ckpt")) == [(2, str(tmp_path / "ckpt" / "step_000002"))]


def test_a_save_over_a_committed_checkpoint_renames_it_aside(tmp_path, capfd):
    """A save never deletes a commit at its step (another save of that step, a run racing
    another): the old one is renamed aside, whole and out of discovery's sight. A torn attempt
    is removed."""
    ckpt = tmp_path / "step_000003"
    _save(str(ckpt), {"w": torch.ones(4)})
    _save(str(ckpt), {"w": torch.full((4,), 2.0)})
    (aside,) = tmp_path.glob("step_000003.replaced-*")
    assert f"xtrain: warning: checkpoint {ckpt} was already committed: moved aside to {aside} " \
           "(kept, not deleted)" in capfd.readouterr().err
    assert read(str(aside))["state_dict"]["w"].tolist() == [1.0] * 4
    assert read(str(ckpt))["state_dict"]["w"].tolist() == [2.0] * 4
    assert [path for _, path, _ in step_dirs(str(tmp_path))] == [str(ckpt)]
    shutil.copytree(ckpt, tmp_path / "backup_step_000009")  # a copy kept by hand: not the run's
    assert [path for _, path, _ in step_dirs(str(tmp_path))] == [str(ckpt)]
    shutil.rmtree(tmp_path / "backup_step_000009")
    (ckpt / "COMMITTED").unlink()  # torn: never committed, nothing to keep
    _save(str(ckpt), {"w": torch.full((4,), 3.0)})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000003", aside.name]


def test_a_run_whose_checkpoint_dir_override_was_left_off_is_refused_not_started_over(tmp_path):
    """checkpoint.* overrides keep the run's name, so its dir: the same command without its
    checkpoint.dir=... found no checkpoint where the default puts them and trained from step 0
    over the run's records (on a TPU, a whole run). Refused, naming the dir that holds them; once
    that dir holds none, the run starts over as any run without checkpoints does."""
    run_dir, elsewhere = tmp_path / "run", tmp_path / "ckpt"
    code, _, err = finish(xtrain(run_dir, "trainer.max_steps=3", f"checkpoint.dir={elsewhere}"))
    assert code == 0, err[-3000:]
    records = (run_dir / "metrics.jsonl").read_text()
    code, out, err = finish(xtrain(run_dir, "trainer.max_steps=3"))
    assert code == 2, err[-3000:]
    assert err.splitlines()[-1] == (
        f"xtrain: config error: checkpoint.dir={run_dir}/checkpoints holds no checkpoint of this "
        f"run, but the last training in {run_dir} (.hydra/config.yaml) saved its checkpoints to "
        f"{elsewhere}, newest {elsewhere}/step_000003: this command would train from step 0 over "
        f"the run's records; to continue it, add checkpoint.dir={elsewhere}; to start anew, "
        "choose another run.name")
    assert (run_dir / "metrics.jsonl").read_text() == records and "step " not in out
    code, out, err = finish(xtrain(run_dir, "trainer.max_steps=3", f"checkpoint.dir=file://{elsewhere}/"))
    assert code == 0 and "nothing to train" in out, err[-3000:]  # (one dir, another spelling)
    shutil.rmtree(elsewhere)
    code, out, err = finish(xtrain(run_dir, "trainer.max_steps=3"))
    assert code == 0 and "step      3/3" in out, err[-3000:]


def test_a_run_whose_checkpoint_dir_override_was_left_off_is_refused_where_its_own_dir_is_behind(
        tmp_path):
    """The run trained 2 steps in its own dir, then 2 more from there into checkpoint.dir=...:
    the same command without that override found step 2 in the run's own dir and trained steps 3
    and 4 again over the run's records, passing over the newer checkpoints without a word."""
    run_dir, elsewhere = tmp_path / "run", tmp_path / "ckpt"
    code, _, err = finish(xtrain(run_dir, "trainer.max_steps=2"))
    assert code == 0, err[-3000:]
    own = run_dir / "checkpoints" / "step_000002"
    code, _, err = finish(xtrain(run_dir, "trainer.max_steps=4", f"checkpoint.dir={elsewhere}",
                                 f"checkpoint.resume={own}"))
    assert code == 0, err[-3000:]
    records = (run_dir / "metrics.jsonl").read_text()
    refusal = (
        f"xtrain: config error: this command would resume from {own}, but the last training in "
        f"{run_dir} (.hydra/config.yaml) saved its checkpoints to {elsewhere}, newest "
        f"{elsewhere}/step_000004: this command would train from step 2 over the run's records; "
        f"to continue it, add checkpoint.dir={elsewhere}; to start anew, choose another run.name")
    code, out, err = finish(xtrain(run_dir, "trainer.max_steps=4"))
    assert code == 2, err[-3000:]
    assert err.splitlines()[-1] == refusal
    assert (run_dir / "metrics.jsonl").read_text() == records and "step " not in out
    # a newer commit of its own dir, corrupt: the run passes it over for step 2, behind too (the
    # check before the run compares the newest commit, unverified)
    corrupt = own.parent / "step_000006"
    shutil.copytree(own, corrupt)
    (data,) = (corrupt / "tensors").glob("*.distcp")
    data.write_bytes(data.read_bytes()[:-4096])
    code, out, err = finish(xtrain(run_dir, "trainer.max_steps=6"))
    assert code == 2, err[-3000:]
    assert f"checkpoint {corrupt} is corrupt" in err and err.splitlines()[-1] == refusal
    assert (run_dir / "metrics.jsonl").read_text() == records and "step " not in out


def test_an_earlier_checkpoint_dir_that_does_not_answer_is_said_and_passed_over(tmp_path, monkeypatch,
                                                                                capfd):
    """The run's last training saved to a bucket that does not answer now (here an emulator
    address nothing listens on): said in a line within the remote timeout, not a minute of
    retries ending in a traceback; the run starts in its own dir, as it would have before."""
    import gcsfs

    from conftest import use_gcs_emulator
    from xtrain.inputs import check_checkpoints_not_elsewhere

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing answers there
    use_gcs_emulator(monkeypatch, f"http://127.0.0.1:{port}", tmp_path / "gcloud")
    gcsfs.GCSFileSystem.clear_instance_cache()
    run = tmp_path / "run"
    (run / ".hydra").mkdir(parents=True)
    (run / ".hydra" / "config.yaml").write_text("checkpoint:\n  dir: gs://gone/ckpt\n")
    t0 = time.monotonic()
    check_checkpoints_not_elsewhere(str(run), str(run / "checkpoints"), timeout_s=1.0)
    assert time.monotonic() - t0 < 5
    assert (f"xtrain: warning: the last training in {run} saved its checkpoints elsewhere, which "
            "could not be read (gs://gone/ckpt: no answer within 1 s") in capfd.readouterr().err
    gcsfs.GCSFileSystem.clear_instance_cache()


@pytest.mark.parametrize("slow", ["local checkpoint", "remote data"])
def test_only_remote_inputs_are_checked_against_the_remote_deadline(tmp_path, monkeypatch, compose_config,
                                                                    slow):
    """Data on gs:// and checkpoints on a local disk: verifying the checkpoint to resume reads
    every byte of it (a d16's 2.4 GB from a cold boot disk takes 10-15 s), and was timed against
    data.remote_timeout_s, refused as "gs://...: no answer". Here the slow part sleeps instead
    (the checkpoint's search, or the data's listing); only the remote one is refused."""
    import xtrain.inputs as inputs
    from xtrain.errors import StorageError

    checked = []

    def check(part):
        def run(*args, **kwargs):
            checked.append(part)
            if part == slow:
                time.sleep(1.5)
        return run

    monkeypatch.setattr(inputs, "resume_checkpoint", check("local checkpoint"))
    monkeypatch.setattr(inputs, "check_data", check("remote data"))
    cfg = compose_config(["data=cpp16k", "data.remote_timeout_s=0.5"])
    if slow == "remote data":
        with pytest.raises(StorageError, match="gs://nanochat-training-data-2026: no answer within 0.5 s"):
            inputs.check_inputs(cfg, None, str(tmp_path / "run"))
    else:
        inputs.check_inputs(cfg, None, str(tmp_path / "run"))
        assert checked == ["local checkpoint", "remote data"]


def test_a_failed_save_is_said_in_one_line_naming_a_disk_too_full_for_it(tmp_path):
    """DCP's CheckpointException prints every process's traceback (twice a save: the retry, then
    the giving up); a full disk fails torch's zip writer with only "unexpected pos" (seen on a
    40 MB tmpfs, by hand): the warning gives each process's error in a line and, when the local
    disk has less room than the checkpoint, says so and what retention needs."""
    import traceback

    from torch.distributed.checkpoint.api import CheckpointException

    from xtrain.checkpoint.async_io import failure

    try:
        raise RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 704 vs 598\n"
                           "Exception raised from ...")
    except RuntimeError as e:
        zip_writer = (e, traceback.extract_tb(e.__traceback__))
    error = CheckpointException("save failed", {0: zip_writer, 1: (OSError(28, "No space left on device"), None)})
    each = ("rank 0: RuntimeError: [enforce fail at inline_container.cc:664] . unexpected pos 704 vs 598; "
            "rank 1: OSError: [Errno 28] No space left on device")
    ckpt = tmp_path / "checkpoints" / "step_000015"  # not made yet: the disk of its closest parent
    said = failure(error, str(ckpt), shutil.disk_usage(tmp_path).free + 2**30)
    assert re.fullmatch(re.escape(each) + r"; the disk holding it has \d+ MiB free, this checkpoint "
                        r"needs about \d+ MiB: retention removes old checkpoints only after a new "
                        r"one commits, so checkpoint.dir needs room for checkpoint.keep_last \+ 1 of "
                        r"them", said), said
    assert failure(error, str(ckpt), 2**20) == each  # room enough: the disk is not the cause
    assert failure(OSError("503 from the bucket\nretry"), "gs://b/ckpt/step_000015", 2**60) == (
        "OSError: 503 from the bucket")  # an object store: no disk to measure


SHARDED_SIZE = """
import numpy as np, torch, torch_xla, torch_xla.runtime as xr
import torch_xla.distributed.spmd as xs
from xtrain.checkpoint import io
from xtrain.checkpoint.async_io import _nbytes
xr.use_spmd()
w = torch.zeros(1024, 1024).to(torch_xla.device())
xs.mark_sharding(w, xs.Mesh(np.arange(4), (4,), ("fsdp",)), ("fsdp", None))
print("BYTES", _nbytes(io.snapshot({"w": w}, sharded=True)))
"""


def test_a_sharded_snapshot_counts_its_bytes_for_the_disk_hint():
    """The XLA engine's snapshot holds this host's shards (torch_xla's own type): counted as
    nothing, a full disk was never named as the cause of a failed sharded save."""
    import subprocess
    import sys

    pytest.importorskip("torch_xla")
    env = {**os.environ, "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "4"}
    r = subprocess.run([sys.executable, "-c", SHARDED_SIZE], env=env, capture_output=True, text=True,
                       timeout=300, cwd=Path(__file__).resolve().parent.parent)
    assert r.returncode == 0, r.stderr[-2000:]
    assert f"BYTES {1024 * 1024 * 4}" in r.stdout  # (one host holds all 4 devices' shards)


def test_on_gcs_a_checkpoint_is_set_aside_whole(gcs_bucket):
    """Object stores have no rename: a server-side copy, then the original removed."""
    bucket, _ = gcs_bucket
    url = f"{bucket}/ckpt/step_000003"
    _save(url, {"w": torch.arange(6.0)})
    aside = set_aside(url, "corrupt")
    assert aside.startswith(f"{url}.corrupt-")
    assert committed_checkpoints(f"{bucket}/ckpt") == []
    assert read(aside)["state_dict"]["w"].tolist() == list(range(6))
    assert manifest.problems(aside) == []


def test_a_run_started_from_a_checkpoint_elsewhere_resumes_its_own_newer_work(world, tmp_path):
    """A fine-tune (checkpoint.resume of another run's checkpoint) stopped after committing step 4
    and run again with the same command: its own newer checkpoint wins over the starting point,
    neither refused nor trained again from step 2 (the fleet's re-run after a preemption)."""
    start = world["run"] / "checkpoints" / "step_000002"
    run, args = tmp_path / "finetune", [f"checkpoint.resume={start}", "checkpoint.every=2"]
    code, out, err = finish(xtrain(run, *args, "trainer.max_steps=4"))
    assert code == 0 and f"resuming from {start}" in out, err[-3000:]
    code, out, err = finish(xtrain(run, *args, "trainer.max_steps=6"))
    assert code == 0, err[-3000:]
    own = run / "checkpoints"
    assert f"checkpoint.resume={start} started this run; its own checkpoints are newer" in out
    assert f"resuming from {own}/step_000004" in out and "renamed aside" not in err
    assert [s for s, _ in committed_checkpoints(str(own))] == [4, 6]


def test_a_second_training_of_the_same_run_is_refused_while_the_first_trains(tmp_path):
    """Two trainings in one run dir would interleave metrics.jsonl and replace each other's
    checkpoints: the second is refused at once, leaving the first's console.log and .hydra record
    alone, even while the first is still starting. The lock dies with its process, SIGKILL too."""
    run = tmp_path / "run"

    def wait_for(condition, what):
        deadline = time.time() + 300
        while not condition():
            assert first.poll() is None and time.time() < deadline, f"the first run never {what}"
            time.sleep(0.1)

    first = xtrain(run, "trainer.max_steps=100000", "checkpoint.every=5")
    try:
        wait_for(lambda: list(run.glob(".hydra-held-*")), "took its run dir")
        started = time.time()
        code, _, err = finish(xtrain(run, "trainer.max_steps=99999", "checkpoint.every=5"))
        assert code == EXIT_REFUSED, err[-3000:]
        assert f"{run} is in use: another process is training this run there" in err
        # its pending record stays (xtrain/cli.py): at another moment it could be the first's
        assert "99999" in (run / ".hydra-pending" / "overrides.yaml").read_text()
        assert time.time() - started < 60  # before data, the model or a step (2 cores, loaded)
        wait_for(lambda: list((run / "checkpoints").glob("step_*/COMMITTED")), "checkpointed")
    finally:
        first.kill()
        first.communicate()
    record = (run / ".hydra" / "overrides.yaml").read_text()
    assert "trainer.max_steps=100000" in record and "99999" not in record
    assert "is in use" not in (run / "console.log").read_text()
    # behind its checkpoints, the same run trains nothing: taken, not refused
    code, out, err = finish(xtrain(run, "trainer.max_steps=1", "checkpoint.every=5"))
    assert code == 0 and "resuming from" in out, err[-3000:]
