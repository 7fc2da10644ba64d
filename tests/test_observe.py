"""Watching a run: the logger group (JSONL, W&B offline, TensorBoard) read back after a real
preempted-and-resumed run, W&B without a key (never a prompt), the console and its log file, and
the XLA engine's compile and host-sync counts with every logger on."""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import pty
import select
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from xtrain.checkpoint.layout import is_committed

from conftest import TINY, child_pids, read_jsonl, with_fault
from logreaders import tensorboard_scalars, tensorboard_texts, wandb_runs
from test_checkpoint import finish, wait_for_step, xtrain

ROOT = Path(__file__).resolve().parent.parent
FAKE_KEY = "xtrainfakekey" + "7" * 27  # the length of a W&B key; nothing may write it down
TRAIN_METRICS = {"loss", "lr", "grad_norm", "tokens", "tok_per_s", "tok_per_s_per_chip", "mfu",
                 "step_s", "compute_s", "data_s", "checkpoint_s", "elapsed_s", "eta_s"}
OTHER_METRICS = {"val_loss", "val_bpb", "eval_s", "ckpt_s", "sample_tok_per_s"}
ALL_LOGGERS = "logger=[jsonl,wandb,tensorboard]"


def _no_file_holds(root: Path, secret: str) -> list[str]:
    return [str(p) for p in root.rglob("*") if p.is_file() and secret.encode() in p.read_bytes()]


def _is_png(path: Path) -> bool:
    import matplotlib.image

    return path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and matplotlib.image.imread(path).shape[0] > 100


# Long: one real run, preempted and resumed, then a fresh one, checked from every side.
def test_loggers_hold_the_metrics_keep_the_wandb_run_across_preemption_and_never_the_key(tmp_path):
    env = {"WANDB_MODE": "offline", "WANDB_API_KEY": FAKE_KEY}
    run_dir = tmp_path / "run"
    args = [ALL_LOGGERS, "trainer.max_steps=40", "trainer.eval_every=10", "trainer.sample_every=10",
            "trainer.sample_tokens=8", "checkpoint.every=10"]
    proc = xtrain(run_dir, *args, env=env)
    wait_for_step(run_dir, 12, proc)
    first_id = (run_dir / "wandb-run-id").read_text()
    proc.send_signal(signal.SIGTERM)
    code, out1, err1 = finish(proc)
    assert code == 143, err1[-3000:]
    stopped_at = max(r["step"] for r in read_jsonl(run_dir / "metrics.jsonl") if r["kind"] == "train")
    code, out2, err2 = finish(xtrain(run_dir, *args, env=env))  # the same command
    assert code == 0, err2[-3000:]

    # W&B: each offline start is a run of its own in the run's group (one id would make
    # `wandb sync` keep only the later history), and together they hold every metric
    assert (run_dir / "wandb-run-id").read_text() == first_id
    runs = wandb_runs(run_dir)
    ids = [r["id"] for r in runs]
    assert len(set(ids)) == 2 and all(i.startswith(f"{first_id}-") for i in ids)
    assert {r["group"] for r in runs} == {runs[0]["name"]}
    history = [h for r in runs for h in r["history"]]
    assert {h["trainer/global_step"] for h in history if "loss" in h} == set(range(1, 41))
    assert TRAIN_METRICS | OTHER_METRICS <= set().union(*history)
    assert runs[0]["config"]["model"]["depth"] == 2 and runs[0]["name"] == runs[1]["name"]
    assert runs[0]["config"]["run"]["name"] == runs[0]["name"]
    # TensorBoard: both processes' event files, the same metrics at the same steps
    scalars = tensorboard_scalars(run_dir / "tensorboard")
    assert TRAIN_METRICS | OTHER_METRICS <= set(scalars)
    assert sorted({s for s, _ in scalars["loss"]}) == list(range(1, 41))
    assert {10, 40} <= {s for s, _ in scalars["val_bpb"]} <= {10, 20, 30, 40}  # none at the stop
    assert tensorboard_texts(run_dir / "tensorboard")  # the samples
    jsonl = {(r["kind"], r["step"]): r for r in read_jsonl(run_dir / "metrics.jsonl")}
    assert dict(scalars["loss"])[40] == pytest.approx(jsonl[("train", 40)]["loss"], rel=1e-6)
    assert all(r["time"] > 1.7e9 for r in jsonl.values())  # wall clock on every record
    # training time carries over a resume, as the tokens do (the file holds both processes' records)
    train = [r for r in read_jsonl(run_dir / "metrics.jsonl") if r["kind"] == "train"]
    resumed = next(r for r in train if r["step"] > stopped_at)
    assert resumed["elapsed_s"] >= max(r["elapsed_s"] for r in train if r["step"] <= stopped_at)

    # the key: in no file of the run dir, in nothing printed; the bundle shows it masked
    assert _no_file_holds(run_dir, FAKE_KEY) == []
    assert FAKE_KEY not in out1 + err1 + out2 + err2
    import json

    env_json = json.loads((run_dir / "repro" / f"step_{stopped_at:06d}" / "env.json").read_text())
    assert env_json["WANDB_API_KEY"] == "***" and env_json["WANDB_MODE"] == "offline"
    assert (run_dir / "repro" / "step_000000" / "config.yaml").exists()
    # the console: plain lines (not a terminal) with ETA, all of them also in console.log
    console = (run_dir / "console.log").read_text()
    last = [ln for ln in out2.splitlines() if ln.startswith("step     40/40")][0]
    assert "eta 0:00:00" in last and "mfu" in last and last in console
    assert "W&B: offline (WANDB_MODE=offline)" in out1 and "resuming from" in console
    for name in ("loss.png", "val_bpb.png", "throughput.png"):
        assert _is_png(run_dir / "plots" / name), name

    shutil.rmtree(run_dir)  # a new run under the same name: a new W&B run
    code, _, err = finish(xtrain(run_dir, ALL_LOGGERS, "trainer.max_steps=2", env=env))
    assert code == 0, err[-3000:]
    [fresh] = wandb_runs(run_dir)
    assert fresh["id"].startswith((run_dir / "wandb-run-id").read_text() + "-")
    assert (run_dir / "wandb-run-id").read_text() != first_id


@pytest.mark.parametrize("killed_at", [12, 5], ids=["resumed", "started-over"])
def test_tensorboard_shows_the_steps_a_killed_run_redid_once(tmp_path, killed_at):
    """A run killed after step 10's checkpoint redoes the steps after it when resumed, and one
    killed before it all of them; TensorBoard showed both attempts of them (the charts ran back
    over them), now the last ones alone. W&B continues its run on a resume; a start over is a
    new W&B run of the group, or W&B would draw its steps twice too."""
    run_dir = tmp_path / "run"
    args = ["logger=[jsonl,tensorboard,wandb]", "trainer.max_steps=16", "checkpoint.every=10"]
    proc = xtrain(run_dir, *args, env={"WANDB_MODE": "offline"})
    wait_for_step(run_dir, killed_at, proc)
    if killed_at > 10:  # step 10's save runs beside steps 11, 12...; killed before it commits, the run starts over
        _wait_for_commit(run_dir / "checkpoints" / "step_000010", proc)
    proc.kill()
    proc.wait()
    first_id = (run_dir / "wandb-run-id").read_text()
    code, _, err = finish(xtrain(run_dir, *args, env={"WANDB_MODE": "offline"}))
    assert code == 0, err[-3000:]
    assert ((run_dir / "wandb-run-id").read_text() == first_id) is (killed_at > 10)
    loss = tensorboard_scalars(run_dir / "tensorboard")["loss"]
    assert [s for s, _ in loss] == list(range(1, 17))
    resumed = {r["step"]: r["loss"] for r in read_jsonl(run_dir / "metrics.jsonl") if r["kind"] == "train"}
    assert all(value == pytest.approx(resumed[step], rel=1e-6) for step, value in loss)


def _wait_for_commit(checkpoint: Path, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.time() + timeout
    while not is_committed(str(checkpoint)):
        assert proc.poll() is None and time.time() < deadline, f"{checkpoint} not committed"
        time.sleep(0.05)


def _on_a_terminal(args: list[str], env: dict, timeout: float = 240) -> tuple[int | None, str]:
    """Run ``python -m xtrain args`` with a pseudo-terminal as stdin, stdout and stderr (where W&B
    would ask for a key); returns (exit code or None if it had to be killed, output)."""
    leader, follower = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "xtrain", *args], cwd=ROOT, env=env,
                            stdin=follower, stdout=follower, stderr=follower, close_fds=True)
    os.close(follower)
    out, deadline = io.BytesIO(), time.time() + timeout
    while time.time() < deadline:
        ready, _, _ = select.select([leader], [], [], 0.5)
        if ready:
            try:
                chunk = os.read(leader, 65536)
            except OSError:  # the child closed the terminal
                break
            if not chunk:
                break
            out.write(chunk)
        elif proc.poll() is not None:
            break
    try:
        code = proc.wait(timeout=max(deadline - time.time(), 1))
    except subprocess.TimeoutExpired:  # still running: waiting for an answer, say
        code = None
        proc.kill()
        proc.wait()
    os.close(leader)
    return code, out.getvalue().decode(errors="replace")


STOP_WITH_A_SLOW_SAVE = with_fault("""
import os, signal, time
from xtrain.train.checkpointing import PeriodicCheckpoint
save, batch_end = PeriodicCheckpoint.save, PeriodicCheckpoint.on_train_batch_end
def slow(self, trainer, wait=False):
    saved = save(self, trainer, wait)
    if wait:
        time.sleep(2)  # the stop's checkpoint committed to a slow bucket
    return saved
def signalled(self, trainer, *args):
    if trainer.global_step == 4 and not os.environ.get("XTRAIN_TEST_SIGNALLED"):
        os.environ["XTRAIN_TEST_SIGNALLED"] = "1"
        os.kill(os.getpid(), signal.SIGTERM)
    return batch_end(self, trainer, *args)
PeriodicCheckpoint.save, PeriodicCheckpoint.on_train_batch_end = slow, signalled
""")


def test_elapsed_time_never_goes_back_across_a_stop_and_its_resume(tmp_path):
    """The stop's record came after its checkpoint's save, its elapsed_s counting the save; the
    resumed run goes on from the checkpoint's elapsed_s, taken before the save: its first step
    was logged as earlier than the step before it. The save is made slow (a fault); the stop's
    step is not a logging step (each start's first and last are)."""
    run_dir, args = tmp_path / "run", ["trainer.max_steps=8", "trainer.log_every=100"]
    code, _, err = finish(xtrain(run_dir, *args, fault=STOP_WITH_A_SLOW_SAVE))
    assert code == 143, err[-3000:]
    code, _, err = finish(xtrain(run_dir, *args))
    assert code == 0, err[-3000:]
    elapsed = {r["step"]: r["elapsed_s"] for r in read_jsonl(run_dir / "metrics.jsonl") if r["kind"] == "train"}
    assert sorted(elapsed) == [1, 4, 5, 8]
    assert [elapsed[s] for s in sorted(elapsed)] == sorted(elapsed.values()), elapsed


def test_the_first_step_of_a_start_is_logged_whatever_log_every(tmp_path):
    """So a resumed run's records mark at once where the interrupted attempt's stop counting."""
    run_dir = tmp_path / "run"
    args = ["trainer.log_every=10", "checkpoint.every=4"]
    code, _, err = finish(xtrain(run_dir, *args, "trainer.max_steps=4"))
    assert code == 0, err[-3000:]
    code, _, err = finish(xtrain(run_dir, *args, "trainer.max_steps=12"))
    assert code == 0, err[-3000:]
    train = [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl") if r["kind"] == "train"]
    assert train == [1, 4, 5, 10, 12]  # each start's first and last step, and every tenth


def test_a_training_without_prompts_makes_no_samples(tmp_path):
    """sample.prompts=[] is how a training has no samples whatever trainer.sample_tokens: it
    made empty ones (a ``sample`` line with nothing after it, a rate of 0 in every logger)."""
    run_dir = tmp_path / "run"
    code, out, err = finish(xtrain(run_dir, "trainer.max_steps=2", "trainer.sample_every=1",
                                   "trainer.sample_tokens=8", "sample.prompts=[]"))
    assert code == 0, err[-3000:]
    kinds = {r["kind"] for r in read_jsonl(run_dir / "metrics.jsonl")}
    assert "train" in kinds and "sample" not in kinds and "sample" not in out, out[-3000:]


def test_a_diverged_run_is_said_once_above_the_bar_and_still_ends_with_its_checkpoint(tmp_path):
    """Learning rates far too high make the loss NaN: said once, at the first logged step that
    has it, on a terminal above the progress bar (a warning was glued to the bar's end: written
    to the stderr of before the bar). The end's sample (on NaN probabilities it crashed the run,
    and every re-run of it at its end) is skipped and recorded: the same command again has nothing
    left to do. With stdout closed (``>&-``, some service wrappers) a run trains as with a pipe
    (it failed at its first line)."""
    run_dir = tmp_path / "tty"
    args = [*TINY, "trainer.log_every=1", "trainer.max_steps=6", "trainer.sample_tokens=8",
            "optim.embedding_lr=1e30", "optim.unembedding_lr=1e30", "optim.grad_clip=0"]
    code, out = _on_a_terminal([*args, f"hydra.run.dir={run_dir}"], dict(os.environ))
    assert code == 0, out[-3000:]
    def refuse(constant):
        raise ValueError(f"{constant} is not JSON")

    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    train = [r for r in (json.loads(line, parse_constant=refuse) for line in lines) if r["kind"] == "train"]
    first_nan = next(r["step"] for r in train if r["loss"] is None)  # strict JSON: NaN as null
    # after the bar's "erase line", as the INFO lines
    assert out.count("the training diverged") == 1, out[-3000:]
    assert f"\x1b[2Kxtrain: warning: the loss is nan at step {first_nan}: the training diverged" in out
    assert "step      6 | sample skipped: the weights hold NaN or inf" in out
    assert (run_dir / "checkpoints" / "step_000006" / "COMMITTED").exists()
    code, again, err = finish(subprocess.Popen([sys.executable, "-m", "xtrain", *args, f"hydra.run.dir={run_dir}"],
                                               cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    assert code == 0 and "running now" not in again, err[-3000:]
    closed = subprocess.run([sys.executable, "-m", "xtrain", *TINY, "trainer.max_steps=2",
                             f"hydra.run.dir={tmp_path / 'closed'}"], cwd=ROOT, stdout=None,
                            stderr=subprocess.PIPE, text=True, timeout=240, preexec_fn=lambda: os.close(1))
    assert closed.returncode == 0, closed.stderr[-3000:]
    assert "Logging error" not in closed.stderr
    assert (tmp_path / "closed" / "checkpoints" / "step_000002" / "COMMITTED").exists()
    assert "step      2/2 | loss" in (tmp_path / "closed" / "console.log").read_text()


def test_wandb_without_a_key_on_a_terminal_goes_offline_in_one_line_and_never_prompts(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env["HOME"] = str(tmp_path / "home")  # no ~/.netrc, no W&B settings
    run = [*TINY, "logger=[jsonl,wandb]", "trainer.max_steps=3"]
    code, out = _on_a_terminal([*run, f"hydra.run.dir={tmp_path / 'auto'}"], env)
    assert code == 0, out[-3000:]
    assert "Enter your choice" not in out
    lines = [ln for ln in out.splitlines() if "W&B" in ln]
    assert len(lines) == 1 and "W&B: offline (no key: WANDB_API_KEY unset and none in ~/.netrc)" in lines[0]
    assert len(wandb_runs(tmp_path / "auto")) == 1
    # online asked for explicitly: refused in one line, before any training
    code, out = _on_a_terminal([*run, "logger.wandb.mode=online", f"hydra.run.dir={tmp_path / 'on'}"], env)
    assert code == 2, out[-3000:]
    assert "logger.wandb.mode=online but no W&B key: export WANDB_API_KEY" in out
    assert "step " not in out and not (tmp_path / "on" / "wandb").exists()


def test_wandb_mode_follows_the_key_and_wandb_mode(tmp_path, monkeypatch):
    from xtrain.errors import ConfigError
    from xtrain.observe.wandb_run import choose_mode

    monkeypatch.setenv("HOME", str(tmp_path))
    assert choose_mode("auto", {}) == "offline"
    assert choose_mode("auto", {"WANDB_API_KEY": FAKE_KEY}) == "online"
    assert choose_mode("auto", {"WANDB_API_KEY": FAKE_KEY, "WANDB_MODE": "offline"}) == "offline"
    assert choose_mode("offline", {"WANDB_API_KEY": FAKE_KEY}) == "offline"
    with pytest.raises(ConfigError, match="WANDB_MODE=online but no W&B key"):
        choose_mode("auto", {"WANDB_MODE": "online"})
    with pytest.raises(ConfigError, match="logger.wandb.mode=online but no W&B key"):
        choose_mode("online", {})
    (tmp_path / ".netrc").write_text("machine api.wandb.ai login user password " + FAKE_KEY + "\n")
    (tmp_path / ".netrc").chmod(0o600)
    assert choose_mode("online", {}) == "online"  # `wandb login` stored a key


def test_a_wandb_run_left_open_by_a_failed_job_is_not_the_next_jobs(tmp_path, monkeypatch):
    """Jobs of a sweep share a process: one that failed before closing its run must not hand it
    to the next (W&B's default outside notebooks returns the run already open)."""
    from xtrain.observe.wandb_run import RUN_ID_FILE, wandb_logger

    monkeypatch.delenv("XTRAIN_WANDB_RUN_ID", raising=False)
    first = wandb_logger(str(tmp_path / "a"), str(tmp_path / "a"), "a", {}, mode="offline")
    try:
        second = wandb_logger(str(tmp_path / "b"), str(tmp_path / "b"), "b", {}, mode="offline")
        assert second.experiment.id.startswith((tmp_path / "b" / RUN_ID_FILE).read_text() + "-")
        assert second.experiment.id != first.experiment.id
        second.experiment.finish()
    finally:
        first.experiment.finish()


def test_a_launched_job_that_starts_over_in_its_run_dir_gets_a_new_wandb_run(tmp_path):
    """The launcher names a job's W&B run (RUN_ID_ENV). A start in a run dir that never used that
    id takes it as it is; a start over (step 0 again: killed before its first checkpoint) where
    it was used gets a run of its own, which its resumes keep, and another launcher id wins."""
    from xtrain.observe.wandb_run import RUN_ID_ENV, RUN_ID_FILE, run_id

    run_dir, launched = str(tmp_path), {RUN_ID_ENV: "aaaabbbbcccc"}
    assert run_id(run_dir, launched, renew=True) == "aaaabbbbcccc"  # its first start
    assert run_id(run_dir, launched) == "aaaabbbbcccc"  # resumed
    again = run_id(run_dir, launched, renew=True)  # started over
    assert again.startswith("aaaabbbbcccc-") and (tmp_path / RUN_ID_FILE).read_text() == again
    assert run_id(run_dir, launched) == again  # resumed after starting over
    assert run_id(run_dir, launched, renew=True) not in (again, "aaaabbbbcccc")
    assert run_id(run_dir, {RUN_ID_ENV: "ddddeeeeffff"}) == "ddddeeeeffff"  # another launcher id


def _child_process_names() -> list[str]:
    names = []
    for pid in child_pids(os.getpid()):
        with contextlib.suppress(FileNotFoundError):  # (exited since)
            names.append(Path(f"/proc/{pid}/comm").read_text().strip())
    return names


def test_each_offline_start_is_a_wandb_run_of_its_own_in_the_runs_group(tmp_path, monkeypatch):
    """`wandb sync` of two offline pieces with one id keeps only the later's history, and W&B
    cannot join them (wandb/wandb#3841, #5865): a run dir's offline starts get ids of their own,
    grouped under the run's name. Online, W&B continues the stored id."""
    from xtrain.observe.sinks import LightningSink
    from xtrain.observe.wandb_run import RUN_ID_FILE, attempt_id, wandb_logger

    monkeypatch.delenv("XTRAIN_WANDB_RUN_ID", raising=False)
    for step in (1, 2):  # a start, then its resume
        sink = LightningSink(wandb_logger(str(tmp_path), str(tmp_path), "d2-run", {}, mode="offline",
                                          start_step=step - 1))
        sink.write({"step": step, "loss": 1.0 / step})
        sink.close()
        # W&B's service may still be writing the run's file after run.finish(): closing waits
        # for it to end, so the files below are complete
        assert "wandb-core" not in _child_process_names()
    stored = (tmp_path / RUN_ID_FILE).read_text()
    runs = wandb_runs(tmp_path)
    assert len({r["id"] for r in runs}) == 2 and all(r["id"].startswith(f"{stored}-") for r in runs)
    assert [(r["group"], r["name"]) for r in runs] == [("d2-run", "d2-run")] * 2
    assert sorted(h["trainer/global_step"] for r in runs for h in r["history"]) == [1, 2]
    assert attempt_id("online", stored) == stored


def test_wandb_records_the_codes_git_remote_without_a_token_in_it(tmp_path, monkeypatch,
                                                                  compose_config):
    """A token can be a remote URL's user (GitHub's form: the token as the user, x-oauth-basic as
    the password), which W&B's own capture keeps: the remote it records is the URL without user
    or password."""
    from xtrain.observe import loggers
    from xtrain.observe.bundle import git_remote_url

    token = "ghp_" + "Q1w2E3r4" * 5  # (in pieces: a launcher refuses to sync a file holding one)
    repo = tmp_path / "repo"
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    subprocess.run(["git", "-C", str(repo), "remote", "add", "origin",
                    f"https://{token}:" + "x-oauth-basic@github.com/alice/xtrain.git"], check=True)
    monkeypatch.setattr(loggers, "source_git_root", lambda: repo)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("XTRAIN_WANDB_RUN_ID", raising=False)
    run_dir = tmp_path / "run"
    cfg = compose_config(TINY + ["logger=[jsonl,wandb]"])
    loggers.build_run_log(cfg.logger, str(run_dir), "d2-run", {}, max_steps=1).close()
    [run_file] = (run_dir / "wandb").glob("offline-run-*/run-*.wandb")
    assert b"https://github.com/alice/xtrain.git" in run_file.read_bytes()
    assert _no_file_holds(run_dir, token) == []
    scp_like = tmp_path / "scp"
    subprocess.run(["git", "init", "-q", str(scp_like)], check=True)
    subprocess.run(["git", "-C", str(scp_like), "remote", "add", "origin",
                    "git@github.com:alice/xtrain.git"], check=True)
    assert git_remote_url(scp_like) == "git@github.com:alice/xtrain.git"


def test_wandb_saves_no_code_of_its_own_even_when_its_environment_asks(tmp_path, monkeypatch,
                                                                       compose_config):
    """W&B's code saving (WANDB_SAVE_CODE, or the account's setting online) writes the checkout's
    `git diff` into the run's files unmasked, and uploads it: it stays off (the run's repro/
    keeps the code, masked). The checkout here has an uncommitted line holding a token."""
    import wandb

    from xtrain.observe import loggers

    token = "hf_" + "Zx8Cv7Bn6M" * 3  # (in pieces: a launcher refuses to sync a file holding one)
    repo = tmp_path / "repo"
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    (repo / "train.sh").write_text("python -m xtrain\n")
    subprocess.run(["git", "-C", str(repo), "add", "."], check=True)
    subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t",
                    "commit", "-qm", "x"], check=True)
    (repo / "train.sh").write_text(f"HF_TOKEN={token} python -m xtrain\n")
    monkeypatch.setattr(loggers, "source_git_root", lambda: repo)
    monkeypatch.chdir(repo)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SAVE_CODE", "true")
    monkeypatch.delenv("XTRAIN_WANDB_RUN_ID", raising=False)
    wandb.teardown()  # W&B reads its environment once a process
    try:
        run_dir = tmp_path / "run"
        cfg = compose_config(TINY + ["logger=[jsonl,wandb]"])
        loggers.build_run_log(cfg.logger, str(run_dir), "d2-run", {}, max_steps=1).close()
    finally:
        wandb.teardown()
    [files] = (run_dir / "wandb").glob("offline-run-*/files")
    assert not [p.name for p in files.rglob("*") if p.suffix == ".patch" or p.name == "code"]
    assert _no_file_holds(run_dir, token) == []


@contextlib.contextmanager
def wandb_server_at(port: int, monkeypatch):
    """W&B's server for this test at a local port, with a dummy key and a short init timeout."""
    import wandb

    for name in ("WANDB_MODE", "XTRAIN_WANDB_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("WANDB_API_KEY", FAKE_KEY)
    monkeypatch.setenv("WANDB_INIT_TIMEOUT", "2")
    wandb.teardown()  # W&B reads its environment once a process: a new start reads this one
    try:
        assert wandb.setup().settings.base_url == f"http://127.0.0.1:{port}"  # (never the internet)
        yield
    finally:
        wandb.teardown()  # the next test's W&B reads its own environment


def test_an_unreachable_wandb_is_an_offline_start_with_auto_and_refused_when_online_is_required(
        tmp_path, monkeypatch, caplog, capfd):
    """W&B down must not fail a run (a resume during an outage would not be re-run by the fleet).
    A real server that does not answer: a closed local port, with a short init timeout."""
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with wandb_server_at(port, monkeypatch):
        _unreachable_wandb(tmp_path, port, monkeypatch, caplog, capfd)


def _unreachable_wandb(tmp_path, port: int, monkeypatch, caplog, capfd) -> None:
    import wandb

    from xtrain.errors import EnvironmentMismatch
    from xtrain.observe.wandb_run import RUN_ID_FILE, wandb_logger

    failed = rf"W&B \(http://127.0.0.1:{port}\) could not start the run \(.*\): nothing was trained"
    with pytest.raises(EnvironmentMismatch, match=rf"^logger.wandb.mode=online but {failed}.*or set "
                                                  "logger.wandb.mode=auto"):
        wandb_logger(str(tmp_path / "on"), str(tmp_path / "on"), "r", {}, mode="online")
    run_dir = tmp_path / "auto"  # (W&B holds the refused run's id until its teardown)
    with caplog.at_level("WARNING", logger="xtrain"):
        run = wandb_logger(str(run_dir), str(run_dir), "r", {}, mode="auto").experiment
    try:
        assert run.offline and run.id.startswith((run_dir / RUN_ID_FILE).read_text() + "-")
    finally:
        run.finish()
    [warning] = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warning.startswith(f"W&B (http://127.0.0.1:{port}) could not start the run (")
    assert "this start logs offline; `wandb sync" in warning
    monkeypatch.setenv("WANDB_MODE", "online")  # online required by the environment: refused too
    with pytest.raises(EnvironmentMismatch, match=rf"^WANDB_MODE=online but {failed}.*or unset WANDB_MODE"):
        wandb_logger(str(tmp_path / "env"), str(tmp_path / "env"), "r", {}, mode="auto")
    out, err = capfd.readouterr()
    assert FAKE_KEY not in warning + out + err
    # W&B's service process may still be writing the offline run's file after finish(): read
    # once it has ended (as a training's process does)
    wandb.teardown()
    assert [r["group"] for r in wandb_runs(run_dir)] == ["r"]


def test_a_key_wandb_refuses_is_refused_in_any_mode(tmp_path, monkeypatch):
    """No outage: the start is refused (exit 2) even with logger.wandb.mode=auto, since logging
    offline would hide a key that will never work. W&B's own server cannot be reached here: a
    local stand-in answers every request 401, as W&B's does for a key it does not know."""
    import http.server
    import threading

    from xtrain.errors import EnvironmentMismatch
    from xtrain.observe.wandb_run import wandb_logger

    class Refusing(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            self.send_response(401)
            self.end_headers()
            self.wfile.write(b'{"errors": [{"message": "user is not logged in"}]}')

        do_GET = do_POST

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Refusing)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with wandb_server_at(server.server_address[1], monkeypatch):
            for mode in ("auto", "online"):
                with pytest.raises(EnvironmentMismatch, match=r"^W&B \(http://127.0.0.1:\d+\) refused "
                                                              r"the key \(.*401.*\): check WANDB_API_KEY"):
                    wandb_logger(str(tmp_path / mode), str(tmp_path / mode), "r", {}, mode=mode)
    finally:
        server.shutdown()


def test_logger_options_compose_against_their_schema_and_every_target_imports(compose_config):
    import importlib

    from xtrain.cli import config_dir

    options = sorted(p.stem for p in Path(config_dir(), "logger").glob("*.yaml"))
    assert options == ["jsonl", "many_loggers", "tensorboard", "wandb"]
    assert set(compose_config([]).logger) == {"jsonl", "wandb", "tensorboard"}
    assert compose_config([]).logger.wandb is None  # JSONL only by default
    for choice in (ALL_LOGGERS, "logger=many_loggers"):
        cfg = compose_config([choice])
        for name in ("jsonl", "wandb", "tensorboard"):
            module, _, attr = cfg.logger[name]._target_.rpartition(".")
            assert callable(getattr(importlib.import_module(module), attr))
    cfg = compose_config(["logger=[jsonl,wandb]", "logger.wandb.tags=[a,b]", "logger.wandb.mode=offline"])
    assert list(cfg.logger.wandb.tags) == ["a", "b"] and cfg.logger.tensorboard is None
    # a logger override keeps the run's name (and so its checkpoints and W&B run)
    assert compose_config([ALL_LOGGERS]).run.name == compose_config([]).run.name
    from hydra.errors import ConfigCompositionException

    with pytest.raises(ConfigCompositionException):
        compose_config(["logger=[jsonl,wandb]", "logger.wandb.projct=x"])


def test_eval_scores_reach_every_logger_through_the_run_log(tmp_path, monkeypatch):
    """The path the evaluation code logs through: a record of kind eval, e.g. cpp_pass_rate."""
    from omegaconf import OmegaConf

    from xtrain.config import LoggerConfig
    from xtrain.observe.loggers import build_run_log

    monkeypatch.setenv("WANDB_MODE", "offline")
    cfg = OmegaConf.merge(OmegaConf.structured(LoggerConfig), {"wandb": {}, "tensorboard": {}})
    run_log = build_run_log(cfg, str(tmp_path), "evals", {"model": {"depth": 2}}, max_steps=10)
    run_log.record("eval", 10, {"cpp_pass_rate": 0.25, "cpp_compiled": 0.5})
    run_log.record("eval", 20, {"cpp_pass_rate": 0.5, "cpp_compiled": 0.75})
    run_log.close()
    assert [(r["kind"], r["cpp_pass_rate"]) for r in read_jsonl(tmp_path / "metrics.jsonl")] == \
        [("eval", 0.25), ("eval", 0.5)]
    assert tensorboard_scalars(tmp_path / "tensorboard")["cpp_pass_rate"] == [(10, 0.25), (20, 0.5)]
    history = wandb_runs(tmp_path)[0]["history"]
    assert [(h["trainer/global_step"], h["cpp_pass_rate"]) for h in history] == [(10, 0.25), (20, 0.5)]
    from xtrain.observe.plots import write_run_plots

    written = write_run_plots(str(tmp_path))
    assert [Path(p).name for p in written] == ["eval.png"] and _is_png(Path(written[0]))


def test_the_logging_fetchs_wait_for_the_device_is_compute_time_not_data_time():
    """Under XLA the one fetch per logging interval waits for the device to finish the interval's
    steps. Here a fetch that sleeps stands in for that wait: on XLA:CPU its length depends on
    the model and the machine, too little to assert on with a test-sized model."""
    from types import SimpleNamespace

    import torch

    from xtrain.observe.metrics import MetricsLogger

    records = []
    run_log = SimpleNamespace(record=lambda kind, step, values: records.append(values))

    def device_wait(tensors):
        time.sleep(0.3)
        return [float(t) for t in tensors]

    logger = MetricsLogger(run_log, log_every=1, max_steps=3, fetch=device_wait)
    optimizer = SimpleNamespace(last_lr_multiplier=lambda: torch.tensor(1.0), param_groups=[{"lr": 0.02}])
    module = SimpleNamespace(last_loss=torch.tensor(2.0), step_stats={"grad_norm": torch.tensor(1.0)},
                             optimizers=lambda: SimpleNamespace(optimizer=optimizer))
    trainer = SimpleNamespace(global_step=0, max_steps=3, is_global_zero=True, global_rank=0,
                              strategy=SimpleNamespace(reduce=lambda x, reduce_op: x))
    logger.on_train_start(trainer, module)
    batch = (torch.zeros(2, 1, 9, dtype=torch.long),)
    for step in (1, 2):
        logger.on_train_batch_start(trainer, module, batch, 0)
        trainer.global_step = step
        logger.on_train_batch_end(trainer, module, None, batch, 0)
    second = records[1]  # a whole interval: from the first record's fetch to the end of its own
    assert second["compute_s"] >= 0.3 and second["data_s"] < second["compute_s"] / 3, second


@pytest.mark.parametrize("peak", ["measured", "stated"])
def test_a_cpu_peak_measured_too_low_is_raised_to_the_fastest_steps(compose_config, tmp_path,
                                                                    monkeypatch, capsys, peak):
    """The CPU's peak is measured at start; on a busy machine that figure is too low and MFU
    would pass 100%. A measured peak is then raised to the fastest interval's rate, said once; a
    peak the profile states is kept (an MFU over 1 then shows the profile's figure is wrong)."""
    import xtrain.observe.peak as peak_module
    from xtrain.modes import run

    # stands in for a measurement taken while the CPU was busy: 1 kFLOP/s, far below any step
    monkeypatch.setattr(peak_module, "measured_cpu_flops", lambda: 1e3)
    stated = ["hardware.peak_bf16_tflops_per_chip=1e-9"] if peak == "stated" else []  # 1 kFLOP/s
    cfg = compose_config(TINY + ["trainer.max_steps=15", *stated], output_dir=str(tmp_path))
    run(cfg, str(tmp_path))
    mfu = [r["mfu"] for r in read_jsonl(tmp_path / "metrics.jsonl") if r["kind"] == "train"]
    warned = capsys.readouterr().err.count("above the CPU peak measured at start")
    assert len(mfu) == 4  # steps 1, 5, 10 and 15
    if peak == "measured":
        assert mfu[0] == 1.0 and all(0 < m <= 1 for m in mfu) and warned == 1
    else:
        assert min(mfu) > 1e4 and warned == 0


def test_progress_bar_refreshes_only_when_a_train_record_arrives(monkeypatch):
    from rich.console import Console

    from xtrain.observe.console import ProgressDisplay

    # the lines it logs stay off the root logger: a handler an earlier in-process Hydra run left
    # there (on a stream pytest has closed since) prints "--- Logging error ---" onto the screen
    monkeypatch.setattr(logging.getLogger("xtrain.progress"), "propagate", False)
    screen = io.StringIO()
    display = ProgressDisplay(100, tty=True, console=Console(file=screen, force_terminal=True, width=160))
    display.write({"step": 10, "kind": "train", "loss": 3.5, "lr": 0.02, "tok_per_s": 1234.0,
                   "mfu": 0.12, "elapsed_s": 5.0, "eta_s": 45.0})
    drawn = screen.getvalue()
    assert "10/100" in drawn and "eta 0:00:45" in drawn
    display.write({"step": 10, "kind": "val", "val_loss": 3.6, "val_bpb": 1.2})
    assert screen.getvalue() == drawn  # the bar is not drawn again
    display.write({"step": 20, "kind": "train", "loss": 3.1, "lr": 0.02, "tok_per_s": 1300.0,
                   "elapsed_s": 9.5, "eta_s": 38.0})
    display.close()
    shown = screen.getvalue()
    assert "20/100" in shown and "eta 0:00:38" in shown and "elapsed 0:00:10" in shown
    assert "loss 3.1000" in shown and "12.0%" in shown


def test_console_lines_go_to_stdout_and_console_log_warnings_to_stderr(tmp_path, capsys):
    import logging

    from xtrain.observe.console import ConsoleLog

    with ConsoleLog(str(tmp_path)):
        logging.getLogger("xtrain.test").info("an info line")
        logging.getLogger("xtrain.test").warning("a warning")
        logging.getLogger("lightning.pytorch.test").info("a lightning tip")
    out, err = capsys.readouterr()
    assert out == "an info line\n" and err == "a warning\n"
    saved = (tmp_path / "console.log").read_text()
    assert "INFO xtrain.test: an info line" in saved and "WARNING xtrain.test: a warning" in saved
    assert "lightning tip" not in saved


def test_the_console_and_console_log_mask_secrets_in_messages_and_tracebacks(tmp_path, capsys,
                                                                            monkeypatch):
    """An error may quote a secret (a rejected key, a URL with a token): neither the console nor
    console.log (which outlives the run, and is synced back from TPU VMs) shows it."""
    import logging

    from xtrain.observe.console import ConsoleLog

    secret = "xtrain-test-" + os.urandom(8).hex()
    monkeypatch.setenv("XTRAIN_TEST_TOKEN", secret)
    with pytest.raises(RuntimeError), ConsoleLog(str(tmp_path)):
        logging.getLogger("xtrain.test").info(f"logging in with {secret}")
        logging.getLogger("xtrain.test").warning(f"retrying with {secret}")
        raise RuntimeError(f"401 Unauthorized: key {secret} refused")
    out, err = capsys.readouterr()
    saved = (tmp_path / "console.log").read_text()
    assert secret not in out + err + saved
    assert out == "logging in with ***\n" and err == "retrying with ***\n"
    assert "RuntimeError: 401 Unauthorized: key *** refused" in saved and "retrying with ***" in saved


def test_other_libraries_warnings_reach_console_log_masked_and_their_info_lines_do_not(tmp_path, capsys,
                                                                                     monkeypatch):
    """A library's logger outside xtrain's (urllib3 retrying through a proxy URL with a token)
    went to the root logger's handler, Hydra's: unmasked on stdout, and not in console.log. Its
    warnings are console.log's alone (the console is xtrain's: a refusal stays one line), its
    errors show on stderr too."""
    import logging

    from xtrain.observe.console import ConsoleLog

    secret = "xtrain-test-" + os.urandom(8).hex()
    monkeypatch.setenv("XTRAIN_TEST_TOKEN", secret)
    root, hydras = logging.getLogger(), logging.StreamHandler(sys.stdout)  # as Hydra sets it up
    monkeypatch.setattr(root, "handlers", [hydras])
    with ConsoleLog(str(tmp_path)):
        logging.getLogger("urllib3.connectionpool").warning("Retrying via https://me:" + secret + "@proxy")
        logging.getLogger("urllib3.connectionpool").info("a library's info line")
        logging.getLogger("urllib3.connectionpool").error("Gave up on https://me:" + secret + "@proxy")
    assert root.handlers == [hydras]  # put back
    out, err = capsys.readouterr()
    saved = (tmp_path / "console.log").read_text()
    assert secret not in out + err + saved
    assert out == "" and err == "Gave up on https://***@proxy\n"
    assert "WARNING urllib3.connectionpool: Retrying via https://***@proxy" in saved
    assert "ERROR urllib3.connectionpool: Gave up on https://***@proxy" in saved
    assert "info line" not in saved


def test_console_log_on_gs_takes_lines_logged_inside_its_own_upload(gcs_bucket, capfd):
    """gcsfs logs warnings on fsspec's event-loop thread in the middle of an upload (against the
    emulator: it cannot tell the bucket's type, each upload). console.log's handler, on the root
    logger, then waited for the upload it was called from: the run hung. And a line logged on that
    thread with an upload due uploaded from inside the loop (fsspec refuses: a logging error). Such
    lines are now held for the file's next write."""
    import threading

    import fsspec.asyn

    from conftest import gcs_filesystem
    from xtrain.observe.console import ConsoleLog

    bucket, _ = gcs_bucket
    run_dir = f"{bucket}/runs/console-{os.getpid()}"

    async def a_library_warns():
        logging.getLogger("a_library").warning("a warning on fsspec's loop")

    def run():
        with ConsoleLog(run_dir) as console:
            console.file.remote_flush_s = 0.0  # (every line uploads)
            logging.getLogger("xtrain.test").warning("a line of the run")
            fsspec.asyn.sync(fsspec.asyn.get_loop(), a_library_warns)
            logging.getLogger("xtrain.test").info("the last line")

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(120)
    assert not thread.is_alive(), "console.log's upload waits for itself"
    assert "Logging error" not in capfd.readouterr().err
    saved = gcs_filesystem(bucket).cat_file(f"{run_dir.removeprefix('gs://')}/console.log").decode()
    lines = [line.split(": ", 1)[1] for line in saved.splitlines() if ": " in line]
    mine = [line for line in lines if line in ("a line of the run", "a warning on fsspec's loop", "the last line")]
    assert mine == ["a line of the run", "a warning on fsspec's loop", "the last line"], saved


def test_console_log_through_a_storage_outage_says_so_once_keeps_its_lines_and_the_outcome(capfd):
    """An upload of console.log that failed (gcsfs gave up after its retries) printed Python's
    logging-error report for each line, each line due waited the retries again, and a failed
    upload at the end replaced the run's own outcome with its error. Now: one warning until an
    upload succeeds, the next try a flush interval later, every line in the next upload, and the
    run's outcome its own."""
    import fsspec

    from xtrain.observe.console import ConsoleLog

    memory, root = fsspec.filesystem("memory"), f"/console-{os.getpid()}"
    pipe, tries = memory.pipe_file, []

    def failing(*args, **kwargs):
        tries.append(1)
        raise OSError("upload gave up after retries")

    log = logging.getLogger("xtrain.test")
    memory.pipe_file = failing
    try:
        with pytest.raises(KeyError, match="the run's own error"), ConsoleLog(f"memory://{root}") as console:
            for n in (1, 2, 3):
                log.info(f"line {n}")
            assert len(tries) == 1  # lines 2 and 3: not before the flush interval
            console.file.remote_flush_s = 0.0
            log.info("line 4")
            memory.pipe_file = pipe  # the store answers again
            log.info("line 5")
            memory.pipe_file = failing  # and fails again at the end
            raise KeyError("the run's own error")
        err = capfd.readouterr().err
        said = [line for line in err.splitlines() if "could not be written" in line]
        assert "Logging error" not in err and len(said) == 2, err
        assert all(line.startswith(f"xtrain: warning: {console.file.path} could not be written "
                                   "(OSError: upload gave up after retries)") for line in said), said
        kept = [line.split(": ", 1)[1] for line in memory.cat(f"{root}/console.log").decode().splitlines()]
        assert [line for line in kept if line.startswith("line ")] == [f"line {n}" for n in range(1, 6)]
    finally:
        memory.pipe_file = pipe
        memory.rm(root, recursive=True)


def test_reports_of_two_threads_at_once_are_both_masked(capsys, monkeypatch):
    """Thread B reports (a thread's traceback) while A's report runs, and A's ends first: B's
    text was written past its mask, and sys.stderr was left on A's buffer (all later output
    lost). Reports now take turns."""
    import threading

    from xtrain.observe.console import masked_stderr

    secret = "s3cr3t-" + os.urandom(8).hex()
    monkeypatch.setenv("XTRAIN_TEST_TOKEN", secret)
    stderr = sys.stderr
    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()

    def report_a():
        a_in.set()
        b_in.wait(1.0)  # (B cannot start its report now: it waits its turn)
        print(f"A {secret}", file=sys.stderr)

    def report_b():
        b_in.set()
        a_out.wait(5.0)
        print(f"B {secret}", file=sys.stderr)

    b = threading.Thread(target=lambda: (a_in.wait(5.0), masked_stderr(report_b)))
    b.start()
    masked_stderr(report_a)
    a_out.set()
    b.join(10)
    assert sys.stderr is stderr
    err = capsys.readouterr().err
    assert secret not in err and "A ***" in err and "B ***" in err, err


@pytest.mark.parametrize("full_error", [False, True])
def test_a_crash_outside_the_console_log_prints_its_traceback_with_secrets_masked(tmp_path, full_error):
    """A crash before the run's console log exists (Hydra cannot make the run dir, whose name reads
    a variable holding a secret's value: one named as a secret is refused before, as it is read
    into a field that is not) quotes the secret: Hydra's report of it, or with
    HYDRA_FULL_ERROR=1 the interpreter's traceback, shows it masked."""
    secret = "xtrain-test-" + os.urandom(8).hex()
    (tmp_path / "a_file").write_text("")
    env = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}
    env.update(PYTHONPATH=str(ROOT), XTRAIN_TEST_TOKEN=secret, XTRAIN_TEST_COPY=secret,
               **({"HYDRA_FULL_ERROR": "1"} if full_error else {}))
    r = subprocess.run([sys.executable, "-m", "xtrain", "mode=plan", *TINY,
                        f"hydra.run.dir={tmp_path}/a_file/${{oc.env:XTRAIN_TEST_COPY}}"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and r.stderr.startswith("Traceback (most recent call last):"), r.stderr
    assert secret not in r.stdout + r.stderr
    assert r.stderr.count(f"NotADirectoryError: [Errno 20] Not a directory: '{tmp_path}/a_file/***'") == 1
    assert ("HYDRA_FULL_ERROR=1 for a complete stack trace" in r.stderr) is not full_error
    assert ("in run_and_report" in r.stderr) is full_error  # (Hydra's frames: the interpreter's report)


def test_xla_every_logger_adds_no_compile_and_no_host_sync_and_sampling_keeps_the_step_graph(tmp_path):
    pytest.importorskip("torch_xla")
    from test_xla import common, drive

    base = common(20) + ["hardware.engine=xla", "parallelism=fsdp", "trainer.device_batch_size=1",
                         "trainer.log_every=5", "trainer.eval_every=10"]
    jobs = [{"name": "jsonl", "dir": str(tmp_path / "jsonl"), "overrides": base},
            {"name": "all", "dir": str(tmp_path / "all"), "overrides": base + [ALL_LOGGERS]},
            {"name": "sample", "dir": str(tmp_path / "sample"),
             "overrides": base + ["trainer.sample_every=10", "trainer.sample_tokens=8"]}]
    res = {}
    for job in jobs:  # one process each: XLA's counters are per process
        res.update(drive([job], 4))
    train = {name: [r for r in res[name]["records"] if r["kind"] == "train"] for name in res}
    counts = lambda name, key: [(r["step"], r[key]) for r in train[name]]  # noqa: E731
    assert counts("all", "xla_compiles") == counts("jsonl", "xla_compiles")
    assert counts("all", "host_syncs") == counts("jsonl", "host_syncs")
    assert counts("jsonl", "xla_compiles")[-1] == (20, 3)
    # samples run on a CPU copy of the model: the training step's graph count is unchanged
    assert counts("sample", "xla_compiles") == counts("jsonl", "xla_compiles")
    samples = [r for r in res["sample"]["records"] if r["kind"] == "sample"]
    assert [r["step"] for r in samples] == [10, 20] and all(s["text"] for s in samples[-1]["samples"])
    assert tensorboard_scalars(Path(tmp_path / "all" / "tensorboard"))["loss"][-1][0] == 20


def test_a_sink_that_fails_is_said_and_neither_stops_training_nor_the_other_sinks(tmp_path, capfd):
    """metrics.jsonl on gs:// whose 30-second upload gives up (here: a memory:// store whose
    write raises, as gcsfs does once its retries are spent) went up through the training step,
    and at the run's end replaced its outcome; the sinks after it missed the record."""
    import fsspec

    from xtrain.observe.sinks import JsonlSink, RunLog, Sink

    class Kept(Sink):
        def __init__(self):
            self.records, self.closed = [], None

        def write(self, record):
            self.records.append(record["step"])

        def close(self, status="success"):
            self.closed = status

    memory, root = fsspec.filesystem("memory"), f"/sink-{os.getpid()}"
    jsonl, kept = JsonlSink(f"memory://{root}"), Kept()
    jsonl.file.remote_flush_s = 0.0  # (every record uploads)
    run_log = RunLog([jsonl, kept])
    pipe, broken = memory.pipe_file, OSError("upload gave up after retries")

    def failing(*args, **kwargs):
        raise broken

    memory.pipe_file = failing
    try:
        for step in (1, 2):
            run_log.record("train", step, {"loss": 1.0})
        memory.pipe_file = pipe  # the store answers again: the next upload carries every line
        run_log.record("train", 3, {"loss": 1.0})
        memory.pipe_file = failing
        run_log.record("train", 4, {"loss": 1.0})
        run_log.close("preempted")
        said = [line for line in capfd.readouterr().err.splitlines() if "upload gave up" in line]
        assert kept.records == [1, 2, 3, 4] and kept.closed == "preempted"
        assert [r["step"] for r in map(json.loads, memory.cat(f"{root}/metrics.jsonl").splitlines())] \
            == [1, 2, 3]
        assert len(said) == 2 and all(f"memory://{root}/metrics.jsonl" in line for line in said), said
    finally:
        memory.pipe_file = pipe
        memory.rm(root, recursive=True)


def test_metrics_through_a_storage_outage_try_once_a_flush_interval_and_say_it_once(capfd):
    """After a failed upload of metrics.jsonl the next try is a flush interval later (each record
    waited gcsfs's retries again); the records between, kept for it, do not count as the sink
    working again, so the outage is said once."""
    import fsspec

    from xtrain.observe.sinks import JsonlSink, RunLog

    memory, root = fsspec.filesystem("memory"), f"/outage-{os.getpid()}"
    jsonl, pipe, tries = JsonlSink(f"memory://{root}"), memory.pipe_file, []

    def failing(*args, **kwargs):
        tries.append(1)
        raise OSError("upload gave up after retries")

    run_log = RunLog([jsonl])
    memory.pipe_file = failing
    try:
        for step in (1, 2, 3):
            run_log.record("train", step, {"loss": 1.0})
        assert len(tries) == 1
        jsonl.file.remote_flush_s = 0.0  # (the interval is over)
        run_log.record("train", 4, {"loss": 1.0})
        memory.pipe_file = pipe
        run_log.close()
        said = [line for line in capfd.readouterr().err.splitlines() if "upload gave up" in line]
        assert len(tries) == 2 and len(said) == 1, said
        assert [r["step"] for r in map(json.loads, memory.cat(f"{root}/metrics.jsonl").splitlines())] \
            == [1, 2, 3, 4]
    finally:
        memory.pipe_file = pipe
        memory.rm(root, recursive=True)


def test_a_failing_sinks_warning_names_the_error_a_logger_raised_it_from(capfd):
    """Lightning's TensorBoardLogger re-raises a write's error as a ValueError about the value
    logged; the warning names the error it came from (a directory that is a file, a full disk)."""
    from xtrain.observe.sinks import RunLog, Sink

    class Rewrapping(Sink):
        def write(self, record):
            try:
                raise NotADirectoryError(20, "Not a directory", "run/tensorboard")
            except OSError as e:
                raise ValueError("you tried to log 8.3 which is currently not supported") from e

    RunLog([Rewrapping()]).record("train", 1, {"loss": 1.0})
    said = capfd.readouterr().err
    assert "ValueError: you tried to log 8.3" in said and "from NotADirectoryError" in said, said
    assert "Not a directory: 'run/tensorboard'" in said, said


@pytest.mark.parametrize("where", ["local", "memory"])
def test_a_line_cut_short_does_not_swallow_the_next_runs_first_record(tmp_path, where):
    """A VM stopped mid-write leaves metrics.jsonl's last line cut short, without its newline.
    The resumed run's first record (its preemption record) goes on a line of its own: only the
    cut line is skipped. Also for a file in an object store (rewritten whole)."""
    import fsspec

    from xtrain.observe.plots import read_records
    from xtrain.observe.sinks import JsonlSink

    run_dir = str(tmp_path) if where == "local" else f"memory:///cut-{os.getpid()}"
    fs, root = fsspec.core.url_to_fs(run_dir)
    fs.makedirs(root, exist_ok=True)
    fs.pipe_file(f"{root}/metrics.jsonl", b'{"step": 10, "kind": "train", "loss": 2.0}\n'
                                          b'{"step": 20, "kind": "train", "lo')
    try:
        sink = JsonlSink(run_dir)
        sink.write({"step": 11, "kind": "preemption", "preemptions": 1})
        sink.write({"step": 12, "kind": "train", "loss": 1.5})
        sink.close("success")
        records = read_records(run_dir)
        assert [(r["step"], r["kind"]) for r in records] == [(10, "train"), (11, "preemption"),
                                                             (12, "train")]
    finally:
        if where == "memory":
            fs.rm(root, recursive=True)
