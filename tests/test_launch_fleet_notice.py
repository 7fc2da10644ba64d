"""A job that stopped itself (exit 143) for a GCE notice, as its run's ``stop`` record says: the
fleet takes the stop for the VM's (xtrain/launcher/fleet.py ``attempt``). It watches the VM the
job's maintenance lead longer than after a signal; a VM that goes down meanwhile is a preemption,
one that stays up gets the job again (counted against max_recreates). A signal's stop keeps its
rule: a preemption only if the VM goes down within VM_DOWN_WAIT_S.

gcloud is the stand-in of tests/sshd.py, replaying the VM's states one describe at a time;
launch_job is stood in for (its result is what the decision reads: the run's real stop records
are tested in tests/test_notices.py and tests/test_checkpoint.py, and how they reach the result
below and in tests/test_launch_e2e.py). The waits are shrunk through VM_DOWN_WAIT_S and
``notice_lead_s`` (preemption.maintenance_lead_s) instead of slept for minutes.
"""

from __future__ import annotations

import json
import time
from datetime import datetime, timedelta, timezone
from types import SimpleNamespace

import pytest

from tests.sshd import HOSTS, gcloud, tpu_node  # noqa: F401  (fixtures)
from tests.test_launch_fleet import ZONE, fleet_cfg
from xtrain.launcher import fleet, pool
from xtrain.launcher.job import JobState
from xtrain.launcher.launch import result
from xtrain.launcher.runner import LaunchError

NOTICE = {"preempted": True, "step": 12, "stopped_for": "notice",
          "stop_reason": "GCE notice instance/upcoming-maintenance: SCHEDULED PENDING"}
SIGNAL = {"preempted": True, "step": 12, "stopped_for": "signal", "stop_reason": "SIGTERM"}
FINISHED = {"step": 40, "loss": 1.25}


@pytest.fixture
def v6e4(compose_config):
    return compose_config(["hardware=v6e4"]).hardware


def stand_in(monkeypatch, results, gcloud=None, node=None, states_then=None) -> list[dict]:
    """launch_job answering ``results`` in turn; the first call sets the VM's states from then on
    (``states_then``, one per describe). Returns each call's job environment."""
    envs = []

    def launch(cfg, *args, **kwargs):
        envs.append(dict(cfg.env))
        if states_then and len(envs) == 1:
            gcloud.add({**node, "x-states": states_then})
        return next(results)

    monkeypatch.setattr(fleet, "launch_job", launch)
    return envs


def run_job(tmp_path, v6e4, **job) -> tuple[dict, list[str], float]:
    """fleet.run_on_vm of one job on vm-a (fleet_cfg's fields): its result, the fleet's messages
    and the seconds it took."""
    messages, t0 = [], time.monotonic()
    out = fleet.run_on_vm(fleet.Job(fleet_cfg(tmp_path), v6e4, [], "run", str(tmp_path / "job"),
                                    **job), log=messages.append)
    return out, messages, time.monotonic() - t0


def changes(gcloud) -> list[str]:
    return [c[3] for c in gcloud.calls() if c[3] != "describe"]


def test_a_notice_stop_whose_vm_stays_up_past_the_lead_is_rerun_on_the_same_vm(
        gcloud, tmp_path, v6e4, monkeypatch):
    """The maintenance was cancelled (or done by live migration): the VM stays READY past
    VM_DOWN_WAIT_S plus the lead, and the job runs again there, not recreated, as a preemption."""
    gcloud.add(tpu_node("vm-a", ZONE, "v6e-4", [("10.0.0.5", HOSTS[0])]))
    monkeypatch.setattr(fleet, "VM_DOWN_WAIT_S", 0.2)
    envs = stand_in(monkeypatch, iter([NOTICE, FINISHED]))
    out, messages, seconds = run_job(tmp_path, v6e4, notice_lead_s=0.4)
    assert seconds >= 0.6  # watched VM_DOWN_WAIT_S + the lead, not less
    assert (out["step"], out["loss"], out["preemptions"]) == (40, 1.25, 1)
    assert changes(gcloud) == []  # the same VM, neither deleted nor created
    assert "fleet: the job on TPU vm-a stopped for a GCE notice; watching the VM for up to 0.6 s" \
        in messages
    assert any(m.startswith("fleet: TPU vm-a is still READY after the job's GCE notice: job run "
                            "preempted (preemption 1)") for m in messages), messages
    assert "fleet: re-running run on TPU vm-a (it resumes from its newest committed checkpoint)" \
        in messages
    assert envs[1]["XTRAIN_PREEMPTIONS"] == "1" and float(envs[1]["XTRAIN_TIME_LOST_S"]) >= 0.6


@pytest.mark.parametrize("stopped_for", ["notice", "signal"])
def test_a_vm_down_after_the_signal_wait_but_within_the_lead_preempted_a_notice_stop_only(
        gcloud, tmp_path, v6e4, monkeypatch, stopped_for):
    """The VM goes down at the fourth describe after the stop: later than VM_DOWN_WAIT_S (0 here:
    a signal's watch looks once), within the notice's lead (30 s). A notice's stop is then a
    preemption (the VM recreated, the job re-run); a signal's is the job's own, as before."""
    node = tpu_node("vm-a", ZONE, "v6e-4", [("10.0.0.5", HOSTS[0])])
    gcloud.add(node)
    gcloud.scenario("vm-a", states=["CREATING", "READY"])
    monkeypatch.setattr(fleet, "VM_DOWN_WAIT_S", 0.0)
    stop = NOTICE if stopped_for == "notice" else SIGNAL
    stand_in(monkeypatch, iter([stop, FINISHED]), gcloud, node,
             states_then=["READY", "READY", "READY", "PREEMPTED"])
    messages = []
    job = fleet.Job(fleet_cfg(tmp_path), v6e4, [], "run", str(tmp_path / "job"), notice_lead_s=30)
    out = fleet.run_on_vm(job, log=messages.append)
    if stopped_for == "notice":
        assert (out["step"], out["preemptions"]) == (40, 1)
        assert changes(gcloud) == ["delete", "create"]
        assert any("fleet: TPU vm-a is PREEMPTED: job run preempted (preemption 1)" in m
                   for m in messages), messages
    else:
        assert (out["step"], out["preempted"], out["preemptions"]) == (12, True, 0)
        assert changes(gcloud) == []
        assert "fleet: TPU vm-a is still READY: the stop was the job's own, not a preemption" \
            in messages


def test_a_vm_that_keeps_sending_notices_ends_the_job_after_max_recreates(
        gcloud, tmp_path, v6e4, monkeypatch):
    """Every run of the job stops for a notice at once and the VM stays up (gcloud showing no
    maintenance for it): each re-run counts as a preemption, so the loop ends with the budget."""
    gcloud.add(tpu_node("vm-a", ZONE, "v6e-4", [("10.0.0.5", HOSTS[0])]))
    monkeypatch.setattr(fleet, "VM_DOWN_WAIT_S", 0.0)
    envs = stand_in(monkeypatch, iter([NOTICE] * 10))
    job = fleet.Job(fleet_cfg(tmp_path, max_recreates=2), v6e4, [], "run", str(tmp_path / "job"))
    messages = []
    with pytest.raises(LaunchError, match=r"^job run: preempted 3 times, more than "
                                          r"hydra.launcher.max_recreates=2: giving up"):
        fleet.run_on_vm(job, log=messages.append)
    assert len(envs) == 3 and changes(gcloud) == []
    # between the runs the VM was never down: not said to be "READY again"
    assert sum("is still READY after the job's GCE notice" in m for m in messages) == 3, messages
    assert not any("READY again" in m for m in messages), messages


def maintenance_window(started_s: float, ends_in_s: float) -> dict:
    """A node's ``upcomingMaintenance`` (TPU API v2 Node): a window opened ``started_s`` ago."""
    def at(offset_s):
        when = datetime.now(timezone.utc) + timedelta(seconds=offset_s)
        return when.isoformat(timespec="milliseconds").replace("+00:00", "Z")

    return {"type": "SCHEDULED", "canReschedule": True, "maintenanceStatus": "PENDING",
            "windowStartTime": at(-started_s), "windowEndTime": at(ends_in_s),
            "latestWindowStartTime": at(-started_s)}


@pytest.mark.parametrize("vm_goes_down", [False, True])
def test_after_a_notice_stop_the_vm_takes_no_job_while_gcloud_shows_its_maintenance(
        gcloud, tmp_path, v6e4, monkeypatch, vm_goes_down):
    """gcloud shows the node's window open (the notice the job stopped for) past VM_DOWN_WAIT_S
    plus the lead: with recreate, the job is not run again into the same window (it would stop at
    once, each run spending one of max_recreates) until the window ends: then once, one
    preemption counted. A VM that goes down inside the window is recreated, as for any
    preemption."""
    window = maintenance_window(started_s=60, ends_in_s=60 if vm_goes_down else 1.5)
    node = {**tpu_node("vm-a", ZONE, "v6e-4", [("10.0.0.5", HOSTS[0])]),
            "upcomingMaintenance": window}
    gcloud.add({**node, "x-states": ["READY"] * 12 + ["PREEMPTED"]} if vm_goes_down else node)
    gcloud.scenario("vm-a", states=["CREATING", "READY"])
    monkeypatch.setattr(fleet, "VM_DOWN_WAIT_S", 0.1)
    envs = stand_in(monkeypatch, iter([NOTICE, FINISHED]))
    out, messages, seconds = run_job(tmp_path, v6e4, notice_lead_s=0.1)
    assert (out["step"], out["preemptions"], len(envs)) == (40, 1, 2)
    assert any(m.startswith("fleet: TPU vm-a announces maintenance (SCHEDULED PENDING, window "
                            f"starts {window['windowStartTime']} (") for m in messages), messages
    if vm_goes_down:
        assert changes(gcloud) == ["delete", "create"]
        assert seconds < 30  # the wait ended with the VM, long before the window
    else:
        assert seconds >= 1.5  # until the window's end, not VM_DOWN_WAIT_S + lead
        assert changes(gcloud) == []
        assert any(m.startswith("fleet: TPU vm-a: its maintenance is no longer announced")
                   for m in messages), messages


def test_the_wait_for_maintenance_ends_after_maintenance_wait_s(gcloud, tmp_path, v6e4,
                                                                monkeypatch):
    gcloud.add({**tpu_node("vm-a", ZONE, "v6e-4", [("10.0.0.5", HOSTS[0])]),
                "upcomingMaintenance": maintenance_window(started_s=60, ends_in_s=3600)})
    monkeypatch.setattr(fleet, "VM_DOWN_WAIT_S", 0.1)
    envs = stand_in(monkeypatch, iter([NOTICE, FINISHED]))
    job = fleet.Job(fleet_cfg(tmp_path, maintenance_wait_s=0.5), v6e4, [], "run",
                    str(tmp_path / "job"), notice_lead_s=0.1)
    messages = []
    t0 = time.monotonic()
    out = fleet.run_on_vm(job, log=messages.append)
    assert (out["step"], len(envs)) == (40, 2) and 0.5 <= time.monotonic() - t0 < 30
    assert any(m.startswith("fleet: TPU vm-a: maintenance not over after ")
               and "(last seen: SCHEDULED PENDING" in m for m in messages), messages


def test_a_node_under_maintenance_is_waited_for_until_healthy(gcloud, tmp_path, v6e4):
    """The maintenance under way: the node READY with health UNHEALTHY_MAINTENANCE (two
    describes here) takes no job either; healthy again with nothing announced, the wait ends."""
    gcloud.add({**tpu_node("vm-a", ZONE, "v6e-4", [("10.0.0.5", HOSTS[0])]),
                "x-health": ["UNHEALTHY_MAINTENANCE", "UNHEALTHY_MAINTENANCE", "HEALTHY"]})
    messages = []
    vm = fleet.Vm("vm-a", fleet_cfg(tmp_path), v6e4, log=messages.append)
    vm.wait_out_maintenance(0.1)
    assert [c[3] for c in gcloud.calls()] == ["describe"] * 3
    assert messages[0].startswith("fleet: TPU vm-a announces maintenance (health "
                                  "UNHEALTHY_MAINTENANCE): it takes no job until that is over")
    assert messages[1].startswith("fleet: TPU vm-a: its maintenance is no longer announced")


def test_without_recreate_a_notice_stop_ends_the_launch_without_waiting_for_the_window(
        gcloud, tmp_path, v6e4, monkeypatch):
    """Nothing is re-run without recreate: the launch ends as stopped (run it again later), not
    after the node's maintenance window."""
    gcloud.add({**tpu_node("vm-a", ZONE, "v6e-4", [("10.0.0.5", HOSTS[0])]),
                "upcomingMaintenance": maintenance_window(started_s=60, ends_in_s=3600)})
    monkeypatch.setattr(fleet, "VM_DOWN_WAIT_S", 0.1)
    stand_in(monkeypatch, iter([NOTICE]))
    messages = []
    job = fleet.Job(fleet_cfg(tmp_path, recreate=False), v6e4, [], "run", str(tmp_path / "job"),
                    notice_lead_s=0.1)
    out = fleet.run_on_vm(job, log=messages.append)
    assert (out["preempted"], out["stopped_for"]) == (True, "notice")
    assert not any("announces maintenance" in m for m in messages), messages


def test_a_gcloud_that_cannot_say_whether_maintenance_is_announced_is_not_waited_for(
        tmp_path, v6e4):
    """gcloud failing (a stand-in failing by hand: the real CLI cannot run here) before any
    maintenance was seen: no verdict, so the VM is not held back."""
    vm = fleet.Vm("vm-a", fleet_cfg(tmp_path), v6e4, log=(messages := []).append)

    def fails(*args, **kwargs):
        raise LaunchError("gcloud: deadline exceeded")

    vm.gcloud.find = fails
    vm.wait_out_maintenance(300)
    assert messages == ["fleet: TPU vm-a: gcloud: deadline exceeded; its maintenance unknown, "
                        "not waited for"]


def test_a_pool_vm_waits_out_its_maintenance_while_another_takes_the_job(
        gcloud, tmp_path, v6e4, monkeypatch):
    """In a pool with recreate (checkpoints in a bucket, as recreate needs) the noticed job goes
    back to the queue at once, for another VM, while the noticed VM takes no job until gcloud no
    longer shows its maintenance, or until no job is left (here: the pool ends with the other
    VM's run, not with the hour's window)."""
    nodes = {name: tpu_node(name, ZONE, "v6e-4", [(host, host)])
             for name, host in (("vm-a", HOSTS[0]), ("vm-b", HOSTS[1]))}
    for node in nodes.values():
        gcloud.add(node)
    monkeypatch.setattr(fleet, "VM_DOWN_WAIT_S", 0.0)
    monkeypatch.setattr(pool, "locate", lambda *args, **kwargs: {})  # no earlier launch to find
    ran_on = []

    def launch(cfg, *args, **kwargs):
        ran_on.append(cfg.tpu)
        if len(ran_on) > 1:
            return FINISHED
        gcloud.add({**nodes[cfg.tpu], "upcomingMaintenance": maintenance_window(60, 3600)})
        return NOTICE

    monkeypatch.setattr(fleet, "launch_job", launch)
    # maintenance_wait_s bounds a wait that would outlast the pool's jobs: 40 s, not 6 h
    cfg = fleet_cfg(tmp_path, tpu=None, pool=["vm-a", "vm-b"], maintenance_wait_s=40)
    messages = []
    t0 = time.monotonic()
    (outcome,) = pool.run_pool([fleet.Job(cfg, v6e4, [], "run", str(tmp_path / "job"),
                                          checkpoint_dir="gs://bucket/ckpt")], log=messages.append)
    assert time.monotonic() - t0 < 30
    assert (outcome.state, outcome.history.count, outcome.result["step"]) == ("finished", 1, 40)
    assert ran_on[0] != ran_on[1]
    assert any(m.startswith(f"[{ran_on[0]}] fleet: TPU {ran_on[0]} announces maintenance")
               for m in messages), messages


@pytest.mark.parametrize("recreate, checkpoint_dir", [(True, "gs://bucket/ckpt"),
                                                      (False, "gs://bucket/ckpt"), (False, None)])
def test_a_pool_job_stopped_for_a_notice_runs_again(gcloud, tmp_path, v6e4, monkeypatch,
                                                    recreate, checkpoint_dir):
    """In a pool the job goes back to the queue: to the same VM with ``recreate`` (nothing to
    recreate: it is READY). Without it the noticed VM leaves the pool, and the job runs on
    another VM if its checkpoints are in a bucket; with them on the noticed VM's disk it ends
    stopped, for the same command to resume it there."""
    for name, host in (("vm-a", HOSTS[0]), ("vm-b", HOSTS[1])):
        gcloud.add(tpu_node(name, ZONE, "v6e-4", [(host, host)]))
    monkeypatch.setattr(fleet, "VM_DOWN_WAIT_S", 0.0)
    monkeypatch.setattr(pool, "locate", lambda *args, **kwargs: {})  # no earlier launch to find
    vms = ["vm-a"] if recreate else ["vm-a", "vm-b"]
    ran_on = []

    def launch(cfg, *args, **kwargs):
        ran_on.append(cfg.tpu)
        return NOTICE if len(ran_on) == 1 else FINISHED

    monkeypatch.setattr(fleet, "launch_job", launch)
    cfg = fleet_cfg(tmp_path, tpu=None, pool=vms, recreate=recreate)
    messages = []
    (outcome,) = pool.run_pool([fleet.Job(cfg, v6e4, [], "run", str(tmp_path / "job"),
                                          checkpoint_dir=checkpoint_dir)], log=messages.append)
    assert changes(gcloud) == []
    noticed = ran_on[0]
    if checkpoint_dir:
        assert (outcome.state, outcome.history.count, outcome.result["step"]) == (
            "finished", 1, 40)
        assert ran_on[1] == noticed if recreate else ran_on[1] != noticed
    else:
        assert (outcome.state, outcome.history.count) == ("stopped", 0)
        assert (outcome.result["stopped_for"], outcome.result["step"]) == ("notice", 12)
        assert ran_on == [noticed]
        assert any(m.startswith(f"[{noticed}] fleet: ") and "checkpoints are on this VM's disk: "
                   "run the same command to resume it here" in m for m in messages), messages
    if not recreate:
        assert (f"[{noticed}] fleet: TPU {noticed} leaves the pool: it is still READY after the "
                "job's GCE notice") in messages


def test_jobs_whose_checkpoints_are_on_a_noticed_vm_are_not_run_elsewhere(gcloud, tmp_path, v6e4,
                                                                         monkeypatch):
    """Two jobs ran on vm-a before, their checkpoints on its disk (locate places both there); the
    first stops for a notice and vm-a leaves the pool, still up: the second is not started on
    vm-b from step 0, it fails naming vm-a, for the same command once vm-a takes jobs again."""
    for name, host in (("vm-a", HOSTS[0]), ("vm-b", HOSTS[1])):
        gcloud.add(tpu_node(name, ZONE, "v6e-4", [(host, host)]))
    monkeypatch.setattr(fleet, "VM_DOWN_WAIT_S", 0.0)
    monkeypatch.setattr(pool, "locate", lambda *args, **kwargs: {0: "vm-a", 1: "vm-a"})
    ran_on = []

    def launch(cfg, *args, **kwargs):
        ran_on.append(cfg.tpu)
        return NOTICE

    monkeypatch.setattr(fleet, "launch_job", launch)
    cfg = fleet_cfg(tmp_path, tpu=None, pool=["vm-a", "vm-b"], recreate=False)
    jobs = [fleet.Job(cfg, v6e4, [], name, str(tmp_path / name)) for name in ("run0", "run1")]
    first, second = pool.run_pool(jobs, log=print)
    assert ran_on == ["vm-a"]
    assert (first.state, second.state) == ("stopped", "failed")
    assert str(second.error).startswith(
        "job run1: not run: it runs on TPU vm-a, or its checkpoints are on that VM's disk, and "
        "TPU vm-a left the pool (it is still READY after the job's GCE notice"), second.error


def test_a_jobs_result_says_why_only_this_attempt_stopped(tmp_path):
    """metrics.jsonl outlives a start of the job (a re-run on the same VM appends to it): a stop
    record of an earlier attempt must not speak for this one (which may have been killed by a
    signal before training, writing none)."""
    rows = [{"step": 5, "kind": "train", "loss": 3.0},
            {"step": 5, "kind": "stop", "stopped_for": "notice", "attempt": "a1"},
            {"step": 9, "kind": "train", "loss": 2.5},
            {"step": 9, "kind": "stop", "stopped_for": "signal", "stop_reason": "SIGTERM",
             "attempt": "a2"}]
    stopped = [JobState("exited", 143, False, None, 0, None)]

    said = []

    def folded(attempt: str, upto: int = len(rows)) -> dict:
        metrics = "".join(json.dumps(r) + "\n" for r in rows[:upto])  # `cat metrics.jsonl`
        worker0 = SimpleNamespace(root="/remote", run=lambda *args: SimpleNamespace(stdout=metrics))
        return result(worker0, "run", str(tmp_path), stopped, said.append, attempt)

    assert folded("a2")["stopped_for"] == "signal"
    assert said[0] == ("launch: the job stopped at a signal (exit 143) after its checkpoint; run "
                       "the same command to resume")
    assert folded("a1", upto=2)["stopped_for"] == "notice"
    # a third start killed before it trained: neither earlier stop is its own
    third = folded("a3")
    assert (third["preempted"], third["step"], third["loss"]) == (True, 9, 2.5)
    assert "stopped_for" not in third and "stop_reason" not in third
    assert ("launch: the job was stopped (exit 143) before this start saved a checkpoint (a signal "
            "while it started up); run the same command to go on from its newest checkpoint, if it "
            "has one") in said[-2:]


def test_the_job_dirs_metrics_keep_the_attempts_of_a_vm_that_was_recreated(tmp_path):
    """Each attempt's result copies rank 0's metrics.jsonl into the job dir. On the same VM the
    remote file continues the copy; a recreated VM's (a new disk) starts over and is appended,
    so the earlier attempts' records stay."""
    from xtrain.observe.plots import read_records

    def rows(*steps) -> str:
        return "".join(json.dumps({"step": s, "kind": "train", "loss": 10.0 - s / 10}) + "\n"
                       for s in steps)

    def fetched(metrics: str) -> str:
        worker0 = SimpleNamespace(root="/remote", run=lambda *args: SimpleNamespace(stdout=metrics))
        result(worker0, "run", str(tmp_path), [JobState("exited", 0, False, None, 0, None)],
               lambda m: None, "a")
        return (tmp_path / "metrics.jsonl").read_text()

    assert fetched(rows(5, 10)) == rows(5, 10)
    assert fetched(rows(5, 10, 15)) == rows(5, 10, 15)  # the same VM: its file, not twice
    assert fetched(rows(15, 20)) == rows(5, 10, 15, 15, 20)  # a new VM resumed at step 10
    assert fetched(rows(15, 20, 25)) == rows(5, 10, 15, 15, 20, 25)  # that VM again
    assert [r["step"] for r in read_records(str(tmp_path))] == [5, 10, 15, 20, 25]
    (tmp_path / "metrics.jsonl").unlink()  # the copy removed by hand: the remote file again
    assert fetched(rows(15, 20, 25)) == rows(15, 20, 25)
    assert fetched(rows(15, 20, 25, 30)) == rows(15, 20, 25, 30)
    # a copy cut short mid-line (the launcher stopped while writing it) keeps the next VM's
    # first record whole
    (tmp_path / "metrics.jsonl").write_text(rows(5, 10) + '{"step": 1')
    (tmp_path / "metrics.jsonl.from").unlink()
    assert fetched(rows(10, 15)) == rows(5, 10) + '{"step": 1\n' + rows(10, 15)
    assert [r["step"] for r in read_records(str(tmp_path))] == [5, 10, 15]


def test_without_recreate_a_notice_stop_whose_vm_stays_up_is_reported_not_failed(
        gcloud, tmp_path, v6e4, monkeypatch):
    """Without recreate nothing is re-run: the stopped job's result is the launch's (exit 143 at
    the command line: run it again to resume), not an error telling to wait for a READY VM."""
    gcloud.add(tpu_node("vm-a", ZONE, "v6e-4", [("10.0.0.5", HOSTS[0])]))
    monkeypatch.setattr(fleet, "VM_DOWN_WAIT_S", 0.1)
    envs = stand_in(monkeypatch, iter([NOTICE]))
    messages = []
    job = fleet.Job(fleet_cfg(tmp_path, recreate=False), v6e4, [], "run", str(tmp_path / "job"),
                    notice_lead_s=0.1)
    out = fleet.run_on_vm(job, log=messages.append)
    assert (out["preempted"], out["step"], out["stopped_for"]) == (True, 12, "notice")
    assert len(envs) == 1 and changes(gcloud) == []
    assert any("the job stopped for its notice; run the same command to resume" in m
               for m in messages), messages


def test_a_gcloud_that_cannot_answer_during_the_watch_gives_no_verdict_before_its_end(
        gcloud, tmp_path, v6e4):
    """gcloud failing while the VM is watched after a notice's stop (its answers are a stand-in's
    here, failing by hand: the real CLI cannot run here) is asked again until the wait is over;
    the job is not re-run at once, into the same notice."""
    vm = fleet.Vm("vm-a", fleet_cfg(tmp_path), v6e4)
    asked = []

    def state():
        asked.append(time.monotonic())
        raise LaunchError("gcloud: deadline exceeded")

    vm.state = state
    t0 = time.monotonic()
    with pytest.raises(fleet.NoticeStop, match="up as far as is known"):
        fleet.wait_for_vm_loss(vm, 0.3, log=print, notice=True)
    assert time.monotonic() - t0 >= 0.3 and len(asked) >= 3
