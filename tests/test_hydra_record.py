"""A launched job's .hydra record: held aside as its launch starts, accepted from there
(xtrain/config/hydra_record.py); the end-to-end case is in tests/test_launch_e2e.py."""

from pathlib import Path

import pytest

from xtrain.config.hydra_record import PENDING, RECORD, accept, discard, hold, release


def write_record(path: Path, overrides: str) -> None:
    path.mkdir(parents=True)
    (path / "overrides.yaml").write_text(overrides)
    (path / "config.yaml").write_text(f"# {overrides}")


def test_a_held_record_is_accepted_and_another_commands_pending_one_is_not_taken(tmp_path):
    write_record(tmp_path / RECORD, "what trained")
    write_record(tmp_path / PENDING, "launched")
    held = hold(str(tmp_path))
    assert not (tmp_path / PENDING).exists()
    write_record(tmp_path / PENDING, "refused meanwhile")  # another command, in the same dir
    accept(str(tmp_path), held)
    assert (tmp_path / RECORD / "overrides.yaml").read_text() == "launched"
    assert (tmp_path / RECORD / "config.yaml").read_text() == "# launched"
    assert (tmp_path / PENDING / "overrides.yaml").read_text() == "refused meanwhile"


def test_records_held_by_launches_never_accepted_go_when_one_is(tmp_path):
    write_record(tmp_path / PENDING, "detached")
    first = hold(str(tmp_path))
    write_record(tmp_path / PENDING, "reattached")
    second = hold(str(tmp_path))
    assert first != second and (tmp_path / first).is_dir()
    accept(str(tmp_path), second)
    assert (tmp_path / RECORD / "overrides.yaml").read_text() == "reattached"
    assert sorted(p.name for p in tmp_path.iterdir()) == [RECORD]
    accept(str(tmp_path), first)  # a late acceptance of the first finds nothing to move
    assert (tmp_path / RECORD / "overrides.yaml").read_text() == "reattached"


def test_a_released_record_is_pending_again_unless_another_commands_is(tmp_path):
    """A command refused after it held its record gives it back for discard; another command's
    pending record written meanwhile stays, and an accepted record is not taken back."""
    write_record(tmp_path / PENDING, "refused")
    held = hold(str(tmp_path))
    release(str(tmp_path), held)
    assert sorted(p.name for p in tmp_path.iterdir()) == [PENDING]
    assert (tmp_path / PENDING / "overrides.yaml").read_text() == "refused"
    held = hold(str(tmp_path))
    write_record(tmp_path / PENDING, "another")
    release(str(tmp_path), held)
    assert sorted(p.name for p in tmp_path.iterdir()) == [PENDING]
    assert (tmp_path / PENDING / "overrides.yaml").read_text() == "another"
    held = hold(str(tmp_path))
    accept(str(tmp_path), held)
    release(str(tmp_path), held)
    release(str(tmp_path), None)  # nothing held (other modes)
    assert sorted(p.name for p in tmp_path.iterdir()) == [RECORD]
    assert (tmp_path / RECORD / "overrides.yaml").read_text() == "another"


def test_a_record_whose_acceptance_failed_is_not_given_back(tmp_path):
    """A launch warns when its accept fails (xtrain/launcher/launch.py accepting) and goes on; if
    it then fails, its record, which passed the checks, is not released for discard."""
    write_record(tmp_path / PENDING, "passed its checks")
    held = hold(str(tmp_path))
    (tmp_path / RECORD).write_text("a file where the record's dir goes")
    with pytest.raises(OSError):
        accept(str(tmp_path), held)
    release(str(tmp_path), held)
    assert not (tmp_path / PENDING).exists()
    assert (tmp_path / held / "overrides.yaml").read_text() == "passed its checks"


def test_nothing_to_hold_outside_a_training(tmp_path):
    write_record(tmp_path / ".hydra-sample", "sample")
    assert hold(str(tmp_path)) is None


def test_a_reattached_launch_accepts_at_a_line_its_local_log_copy_already_holds(tmp_path):
    from xtrain.config.hydra_record import ACCEPTED
    from xtrain.launcher.launch import accepting
    from xtrain.launcher.logs import log_path

    run_dir = str(tmp_path)
    Path(log_path(run_dir, 0)).write_text(f"loading\n{ACCEPTED}\nstep 1\n")
    write_record(tmp_path / PENDING, "cut short")
    on_line = accepting(run_dir, hold(run_dir), print, seen=len("loading\nevery"))
    assert not (tmp_path / RECORD).exists()  # a part of the line is not the line
    on_line(f"echo {ACCEPTED}")  # nor is a line that holds it
    assert not (tmp_path / RECORD).exists()
    on_line(f"\r{ACCEPTED}")  # the line, streamed (after a progress bar's return)
    assert (tmp_path / RECORD / "overrides.yaml").read_text() == "cut short"
    write_record(tmp_path / PENDING, "reattached")
    accepting(run_dir, hold(run_dir), print, seen=len(f"loading\n{ACCEPTED}\n"))
    assert (tmp_path / RECORD / "overrides.yaml").read_text() == "reattached"


def test_discard_takes_this_commands_record_and_an_emptied_run_dir_only(tmp_path, compose_config):
    """A refused command's record goes; another command's pending record (other overrides, written
    meanwhile) stays, and so does the run dir holding it."""
    compose_config(["model.depth=0"])  # sets Hydra's config, as `python -m xtrain model.depth=0`
    run = tmp_path / "run"
    write_record(run / PENDING, "- model.depth=0\n")
    discard(str(run))
    assert not run.exists()
    write_record(run / PENDING, "- model=d12\n")
    discard(str(run))
    assert (run / PENDING / "overrides.yaml").read_text() == "- model=d12\n"
