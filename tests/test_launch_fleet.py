"""The spot fleet's local half: VM states, recreation through gcloud, the pool's queue and its
VMs' refusals, the preemption record, and the refusals before launch. gcloud is the stand-in of
tests/sshd.py (tests/gcloud_standin.py: it replays VM states from a scenario and records its
calls), because Google Cloud cannot be reached from here; the pool's VMs are the loopback hosts
of tests/sshd.py; everything else is real. The end-to-end half, over real SSH with real
training, is tests/test_launch_fleet_e2e.py."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from pathlib import Path
from types import SimpleNamespace

import pytest
from omegaconf import OmegaConf

from xtrain.errors import ConfigError

from tests.sshd import HOSTS, gcloud, remote, sshd, tpu_node  # noqa: F401  (fixtures)
from xtrain.launcher import fleet
from xtrain.launcher.config import LauncherConfig
from xtrain.launcher.fleet import Job
from xtrain.launcher.vm import DOWN, PENDING, UP, Vm, VmLost, vm_health
from xtrain.launcher import gcloud as gcloud_module
from xtrain.launcher.gcloud import NoCapacity, NoVerdict, QuotaExceeded, create_failure
from xtrain.launcher.job import JobState
from xtrain.launcher.jobdir import record_attempt
from xtrain.launcher.launch import launch_job
from xtrain.launcher.pool import JobQueue, Outcome, locate, run_pool, serve, summary
from xtrain.launcher.runner import LaunchError, Runner, VmUnavailable
from xtrain.launcher.targets import node_targets
from xtrain.observe import preemptions

ROOT = Path(__file__).resolve().parent.parent
ZONE = "asia-northeast1-b"
TINY = ["model=d2", "model.sequence_len=64", "trainer.device_batch_size=4", "trainer.log_every=5",
        "trainer.sample_tokens=0"]


def queued_resource(name: str, accelerator: str, state: str) -> dict:
    """A queued resource as `gcloud compute tpus queued-resources describe --format=json` shows it."""
    return {"name": f"projects/xtrain-test/locations/{ZONE}/queuedResources/{name}",
            "tpu": {"nodeSpec": [{"nodeId": name, "node": {"acceleratorType": accelerator,
                                                            "runtimeVersion": "v2-alpha-tpuv6e"}}]},
            "spot": {}, "state": {"state": state}}


def test_vm_states_are_classified_from_the_tables():
    assert vm_health("READY") == UP
    for gone in ("PREEMPTED", "TERMINATED", "STOPPED", "DELETING", "NOT_FOUND", "SOMETHING_NEW"):
        assert vm_health(gone) == DOWN, gone
    assert vm_health("CREATING") == PENDING and vm_health("REPAIRING") == PENDING
    assert vm_health("UNHEALTHY_MAINTENANCE") == PENDING  # READY, health says maintenance
    assert vm_health("ACTIVE", queued=True) == UP
    for gone in ("SUSPENDED", "SUSPENDING", "FAILED"):
        assert vm_health(gone, queued=True) == DOWN, gone
    assert vm_health("WAITING_FOR_RESOURCES", queued=True) == PENDING
    assert vm_health("READY", queued=True) == DOWN  # a node state is not a queued resource's


def fleet_cfg(tmp_path, **fields):
    """Launcher fields for a VM of the stand-in; its login key is a placeholder (a create puts
    the public half in the new VM's ssh-keys metadata; these tests never log in: no login wait)."""
    identity = tmp_path / "id_fleet"
    identity.write_text("not a key: never used to log in\n")
    identity.with_suffix(".pub").write_text("ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIFleetTestKey x\n")
    fields = {"tpu": "vm-a", "zone": ZONE, "recreate": True, "poll_s": 0.05,
              "capacity_backoff_s": 0.1, "ready_timeout_s": 30, "identity_file": str(identity),
              "known_hosts": str(tmp_path / "known_hosts"), "login_grace_s": 0, **fields}
    return OmegaConf.structured(LauncherConfig(**fields))


@pytest.fixture
def v6e4(compose_config):
    return compose_config(["hardware=v6e4"]).hardware


def test_a_preempted_vm_is_deleted_and_recreated_as_the_profile_says(gcloud, tmp_path, v6e4):
    """PREEMPTED -> delete; the first create finds no capacity (backoff), the second works; the
    new VM is CREATING for two describes, then READY. Its old host key is forgotten."""
    gcloud.add(tpu_node("vm-a", ZONE, "v6e-4", [("10.0.0.5", HOSTS[0])], state="PREEMPTED"))
    gcloud.scenario("vm-a", creates=["no-capacity", "ok"], states=["CREATING", "CREATING", "READY"])
    known = tmp_path / "known_hosts"
    known.write_text(f"{HOSTS[0]} ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOldKeyOfThePreemptedVm\n"
                     "127.0.0.9 ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIAnotherHostStays\n")
    messages = []
    t0 = time.monotonic()
    Vm("vm-a", fleet_cfg(tmp_path), v6e4, log=messages.append).restore()
    verbs = [c[3] for c in gcloud.calls() if c[2] == "tpu-vm"]
    assert verbs.count("delete") == 1 and verbs.count("create") == 2
    create = ["compute", "tpus", "tpu-vm", "create", "vm-a", f"--zone={ZONE}",
              "--accelerator-type=v6e-4", "--version=v2-alpha-tpuv6e", "--spot"]
    creates = [c for c in gcloud.calls() if c[3] == "create"]
    assert [c[:-1] for c in creates] == [create, create]  # then the key file (a temporary path)
    assert all(c[-1].startswith("--metadata-from-file=ssh-keys=") for c in creates)
    assert verbs.index("delete") < verbs.index("create")  # never two VMs holding quota
    assert time.monotonic() - t0 >= 0.1  # waited out the capacity backoff
    assert any("no capacity" in m and "RESOURCE_EXHAUSTED" not in m and "no more capacity" in m
               for m in messages)
    assert any("vm-a is PREEMPTED: deleting it" in m for m in messages)
    assert any("vm-a is READY again" in m for m in messages)
    assert known.read_text().splitlines() == [
        "127.0.0.9 ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIAnotherHostStays"]


# What gcloud prints when a create fails, as seen in public reports of real runs (the stand-in
# replays the first of each kind).
STOCKOUTS = [
    'ERROR: (gcloud.compute.tpus.tpu-vm.create) {"code": 8, "message": "There is no more capacity '
    'in the zone \\"us-central1-c\\"; you can try in another zone where Cloud TPU Nodes are '
    'offered (see https://cloud.google.com/tpu/docs/regions) [EID: 0x9f48947a7d57c8d]"}',
    "ERROR: (gcloud.compute.tpus.execution-groups.create) There is no more capacity in the zone "
    '"europe-west4-a"; you can try in another zone where Cloud TPU Nodes are offered (see '
    "https://cloud.google.com/tpu/docs/regions) [EID: 0xba393c906974e61]",
    "ERROR: (gcloud.compute.instances.create) Could not fetch resource:\n---\ncode: "
    "ZONE_RESOURCE_POOL_EXHAUSTED\nmessage: The zone 'projects/p/zones/us-central1-b' does not "
    "have enough resources available to fulfill the request.",
    # a rate quota: the next minute lifts it
    "ERROR: (gcloud.compute.tpus.tpu-vm.create) RESOURCE_EXHAUSTED: Quota exceeded for quota "
    "metric 'Create node requests' and limit 'Create node requests per minute per project' of service "
    "'tpu.googleapis.com' for consumer 'project_number:123'.",
]
QUOTAS = [
    "ERROR: (gcloud.compute.tpus.tpu-vm.create) RESOURCE_EXHAUSTED: Quota limit "
    "'TPUV6EPreemptiblePerProjectPerRegionForTPUAPI' has been exceeded. Limit: 0 in region "
    "us-east5.",
    "ERROR: (gcloud.compute.tpus.tpu-vm.create) RESOURCE_EXHAUSTED: Quota "
    "'TPUV4sPreemptiblePodPerProjectPerRegionForTPUAPI' exhausted. Limit 20800 in region "
    "us-central2",
    "ERROR: (gcloud.compute.instances.create) Could not fetch resource:\n - Quota "
    "'GPUS_ALL_REGIONS' exceeded. Limit: 0.0 globally.",
    "Code: QUOTA_EXCEEDED\nMessage: Quota 'N2_CPUS' exceeded.",
]


def test_a_create_failure_is_told_apart_as_capacity_quota_or_other():
    """A stockout is retried (NoCapacity); a quota, RESOURCE_EXHAUSTED as well, is not."""
    for stderr in STOCKOUTS:
        assert create_failure(stderr) is NoCapacity, stderr
    for stderr in QUOTAS:
        assert create_failure(stderr) is QuotaExceeded, stderr
    assert create_failure("ERROR: (gcloud.compute.tpus.tpu-vm.create) PERMISSION_DENIED: "
                          "Permission 'tpu.nodes.create' denied") is LaunchError


def test_a_failure_with_no_verdict_is_told_apart_by_gcloud_s_error_line():
    """Asked again: a server error, the auth-token refresh, a call cut off. Not: a new login
    needed (no wait gives it), or a refusal whose warning above it mentions a server error."""
    for stderr in ("ERROR: (gcloud.compute.tpus.tpu-vm.create) There was a problem refreshing "
                   "your current auth tokens: ('Connection aborted.', RemoteDisconnected())",
                   "ERROR: (gcloud.compute.tpus.tpu-vm.create) INTERNAL: An internal error "
                   "has occurred.", "ERROR: (gcloud.compute.tpus.tpu-vm.delete) UNAVAILABLE: "
                   "The service is currently unavailable.", "\ntimed out after 1800 s"):
        assert create_failure(stderr) is NoVerdict, stderr
    for stderr in ("ERROR: (gcloud.compute.tpus.tpu-vm.create) There was a problem refreshing "
                   "your current auth tokens: Reauthentication failed. Please run: gcloud auth "
                   "login", "WARNING: an INTERNAL flag is deprecated\nERROR: (gcloud.compute."
                   "tpus.tpu-vm.create) INVALID_ARGUMENT: Runtime version 'x' is not supported"):
        assert create_failure(stderr) is LaunchError, stderr


def test_a_recreation_refused_by_quota_ends_at_once(gcloud, tmp_path, v6e4):
    """The stand-in's create fails with a quota error (a retry would succeed): the recreation
    stops at the first create, without waiting the capacity backoff, and says what to do."""
    gcloud.add(tpu_node("vm-a", ZONE, "v6e-4", [("10.0.0.5", HOSTS[0])], state="PREEMPTED"))
    gcloud.scenario("vm-a", creates=["quota", "ok"])
    messages = []
    t0 = time.monotonic()
    with pytest.raises(QuotaExceeded) as e:
        Vm("vm-a", fleet_cfg(tmp_path, capacity_backoff_s=5, ready_timeout_s=3600), v6e4,
           log=messages.append).restore()
    assert time.monotonic() - t0 < 5  # no backoff slept
    assert [c[3] for c in gcloud.calls() if c[3] != "describe"] == ["delete", "create"]
    assert "quota 'TPUV6EPreemptiblePerProjectPerRegionForTPUAPI'" in str(e.value)
    assert "Limit: 0 in region asia-northeast1" in str(e.value)
    assert "request more quota" in str(e.value) and "another zone" in str(e.value)
    assert not any("no capacity" in m for m in messages)


def test_a_suspended_queued_resource_is_recreated_as_one(gcloud, tmp_path, v6e4):
    gcloud.add(queued_resource("qr-a", "v6e-4", "SUSPENDED"), queued=True)
    gcloud.scenario("qr-a", states=["WAITING_FOR_RESOURCES", "PROVISIONING", "ACTIVE"])
    Vm("qr-a", fleet_cfg(tmp_path, tpu="qr-a", queued=True), v6e4, log=print).restore()
    queued = [c for c in gcloud.calls() if c[2] == "queued-resources"]
    assert ["compute", "tpus", "queued-resources", "delete", "qr-a", f"--zone={ZONE}", "--force",
            "--quiet"] in queued
    assert ["compute", "tpus", "queued-resources", "create", "qr-a", f"--zone={ZONE}",
            "--node-id=qr-a", "--accelerator-type=v6e-4", "--runtime-version=v2-alpha-tpuv6e",
            "--spot"] in [c[:-1] for c in queued]  # then the ssh-keys file
    assert Vm("qr-a", fleet_cfg(tmp_path, tpu="qr-a", queued=True), v6e4).state() == "ACTIVE"


def test_a_suspending_queued_resource_is_deleted_once_suspended(gcloud, tmp_path, v6e4):
    """SUSPENDING: the service is taking the resource down (preempted); the recreation waits for
    SUSPENDED before its delete, as for DELETING."""
    gcloud.add({**queued_resource("qr-a", "v6e-4", "SUSPENDING"),
                "x-states": ["SUSPENDING", "SUSPENDING", "SUSPENDED"]}, queued=True)
    gcloud.scenario("qr-a", states=["ACTIVE"])
    Vm("qr-a", fleet_cfg(tmp_path, tpu="qr-a", queued=True), v6e4, log=print).restore()
    queued = [c[3] for c in gcloud.calls() if c[2] == "queued-resources"]
    assert queued[:5] == ["describe", "describe", "describe", "delete", "describe"], queued
    assert "create" in queued


def test_a_recreation_that_never_gets_ready_is_deleted_and_fails(gcloud, tmp_path, v6e4):
    gcloud.add(tpu_node("vm-a", ZONE, "v6e-4", [("10.0.0.5", HOSTS[0])], state="TERMINATED"))
    gcloud.scenario("vm-a", states=["CREATING"])
    # the timeout leaves time for the delete and the create (stand-in calls of a second or so
    # each on a loaded machine: at 0.3 s it ran out before the create, the VM not found)
    with pytest.raises(LaunchError, match=r"TPU vm-a is still CREATING after 0m\d+s .*"
                                          r"ready_timeout_s=5\)"):
        Vm("vm-a", fleet_cfg(tmp_path, ready_timeout_s=5), v6e4, log=print).restore()
    assert [c[3] for c in gcloud.calls() if c[3] != "describe"] == ["delete", "create", "delete"]


def test_a_vm_deleted_by_an_unfinished_recreation_is_created_by_the_same_command(
        gcloud, tmp_path, v6e4, monkeypatch):
    """The quota refuses the create after the preempted VM was deleted: gcloud no longer knows the
    name. The launcher noted the deletion, so the same command creates the VM (with
    ``recreate``) instead of refusing an unknown name; without ``recreate`` it says what
    happened. A name nobody deleted stays refused: a misspelling must never create a VM."""
    gcloud.add(tpu_node("vm-a", ZONE, "v6e-4", [("10.0.0.5", HOSTS[0])], state="PREEMPTED"))
    gcloud.scenario("vm-a", creates=["quota"], states=["READY"])
    with pytest.raises(QuotaExceeded):
        Vm("vm-a", fleet_cfg(tmp_path), v6e4, log=print).restore()
    assert Vm("vm-a", fleet_cfg(tmp_path), v6e4).state() == "NOT_FOUND"
    with pytest.raises(ConfigError, match=r"^TPU vm-a is gone: xtrain deleted it at 20\d\d-.* to "
                                          r"recreate it, and did not create it again .*; "
                                          r"hydra.launcher.recreate=true creates it$"):
        fleet.check_known(Vm("vm-a", fleet_cfg(tmp_path, recreate=False), v6e4), recreate=False)
    with pytest.raises(ConfigError, match="gcloud does not know TPU vm-b"):
        fleet.check_known(Vm("vm-b", fleet_cfg(tmp_path), v6e4), recreate=True)

    monkeypatch.setattr(fleet, "launch_job", lambda *args, **kwargs: {"step": 40, "loss": 1.25})
    job = fleet.Job(fleet_cfg(tmp_path), v6e4, [], "run", str(tmp_path / "job"))
    assert fleet.run_on_vm(job, log=print)["step"] == 40
    assert [c[3] for c in gcloud.calls() if c[3] != "describe"] == ["delete", "create", "create"]
    assert Vm("vm-a", fleet_cfg(tmp_path), v6e4).deleted_at() is None  # a VM again: note gone


def test_a_recreation_goes_on_through_a_describe_gcloud_fails(gcloud, tmp_path, v6e4):
    """The stand-in's describe fails once while the new VM comes up, as gcloud does when it
    cannot refresh its auth token: the recreation asks again (one create, no second delete) and
    ends with the VM READY instead of failing and leaving it unused."""
    gcloud.add(tpu_node("vm-a", ZONE, "v6e-4", [("10.0.0.5", HOSTS[0])], state="PREEMPTED"))
    gcloud.scenario("vm-a", states=["CREATING", "ANSWERLESS", "READY"])
    messages = []
    Vm("vm-a", fleet_cfg(tmp_path), v6e4, log=messages.append).restore()
    assert [c[3] for c in gcloud.calls() if c[3] != "describe"] == ["delete", "create"]
    assert any("no answer from gcloud" in m and "auth tokens" in m for m in messages), messages
    assert any("vm-a is READY again" in m for m in messages)


def test_a_recreation_asks_again_when_a_delete_or_create_gets_no_answer(gcloud, tmp_path, v6e4):
    """gcloud fails a delete and then a create with no verdict on them (its auth-token refresh):
    the recreation asks again and ends with the VM READY, instead of failing with the VM deleted
    (a pool's VM then left the pool for the rest of the sweep)."""
    gcloud.add(tpu_node("vm-a", ZONE, "v6e-4", [("10.0.0.5", HOSTS[0])], state="PREEMPTED"))
    gcloud.scenario("vm-a", deletes=["answerless"], creates=["answerless"], states=["READY"])
    messages = []
    Vm("vm-a", fleet_cfg(tmp_path), v6e4, log=messages.append).restore()
    assert [c[3] for c in gcloud.calls() if c[3] != "describe"] == ["delete"] * 2 + ["create"] * 2
    asked_again = [m for m in messages if "auth tokens" in m and m.endswith("asking again")]
    assert len(asked_again) == 2, messages
    assert "could not delete TPU 'vm-a'" in asked_again[0]
    assert "could not create TPU 'vm-a'" in asked_again[1]
    assert any("vm-a is READY again" in m and "after the recreation began" in m
               for m in messages), messages


def test_a_create_that_failed_with_no_verdict_but_made_the_vm_is_taken_as_a_new_vm(
        gcloud, tmp_path, v6e4):
    """The create made the VM and then failed (the call cut off): the VM it finds READY next is
    the new one (the old one's host keys forgotten, its login waited for), not the old one back."""
    gcloud.add(tpu_node("vm-a", ZONE, "v6e-4", [("10.0.0.5", HOSTS[0])], state="PREEMPTED"))
    gcloud.scenario("vm-a", creates=["made-answerless"], states=["CREATING", "READY"])
    messages = []
    Vm("vm-a", fleet_cfg(tmp_path), v6e4, log=messages.append).restore()
    assert [c[3] for c in gcloud.calls() if c[3] != "describe"] == ["delete", "create"]
    assert any("vm-a is READY again" in m and "after the recreation began" in m
               for m in messages), messages


def test_a_create_refused_for_another_reason_is_not_asked_again(gcloud, tmp_path, v6e4):
    """Only a failure with no verdict is asked again: gcloud's refusal of the request itself
    (here an unknown runtime version) ends the recreation at once."""
    gcloud.add(tpu_node("vm-a", ZONE, "v6e-4", [("10.0.0.5", HOSTS[0])], state="PREEMPTED"))
    gcloud.scenario("vm-a", creates=["invalid"])
    with pytest.raises(LaunchError, match="INVALID_ARGUMENT"):
        Vm("vm-a", fleet_cfg(tmp_path), v6e4, log=print).restore()
    assert [c[3] for c in gcloud.calls() if c[3] != "describe"] == ["delete", "create"]


def test_a_recreation_whose_login_wait_gets_no_answer_from_gcloud_ends_with_the_vm_ready(
        gcloud, tmp_path, v6e4):
    """gcloud fails the describe that gives the new VM's workers for the login wait: the wait is
    left out (the launch describes the VM again) instead of the recreation failing with the new
    VM left running unused."""
    gcloud.add(tpu_node("vm-a", ZONE, "v6e-4", [("10.0.0.5", HOSTS[0])], state="PREEMPTED"))
    gcloud.scenario("vm-a", states=["READY", "READY", "ANSWERLESS", "READY"])  # (addresses: 2nd)
    messages = []
    Vm("vm-a", fleet_cfg(tmp_path, login_grace_s=60), v6e4, log=messages.append).restore()
    assert [c[3] for c in gcloud.calls() if c[3] != "describe"] == ["delete", "create"]
    assert any("no answer from gcloud, no wait for its login" in m and "auth tokens" in m
               for m in messages), messages
    assert any("vm-a is READY again" in m for m in messages)


def test_a_launch_asks_gcloud_again_for_its_tpu_when_a_describe_gets_no_answer(
        gcloud, tmp_path, monkeypatch):
    """A launch's describe of its TPU that gcloud cannot answer (its auth-token refresh failing)
    is asked again after a wait: answered then, the launch goes on (after a fleet's recreation,
    the re-run of the job with it); never answered, it is refused with gcloud's error after the
    waits; a name gcloud does not know is refused at once."""
    monkeypatch.setattr(gcloud_module, "DESCRIBE_RETRY_WAITS_S", (0.05, 0.1))
    gcloud.add({**tpu_node("vm-a", ZONE, "v6e-4", [("10.0.0.5", HOSTS[0])]),
                "x-states": ["ANSWERLESS", "READY"]})
    gcloud.add({**tpu_node("vm-c", ZONE, "v6e-4", [("10.0.0.7", HOSTS[0])]),
                "x-states": ["ANSWERLESS"]})
    cloud = gcloud_module.Gcloud(Runner())
    assert cloud.describe("vm-a", ZONE)["state"] == "READY"
    with pytest.raises(ConfigError, match=r"gcloud could not describe TPU 'vm-c' in .*: ERROR: "
                                          r".*problem refreshing your current auth tokens"):
        cloud.describe("vm-c", ZONE)
    with pytest.raises(ConfigError, match=r"gcloud could not describe TPU 'vm-x' .*NOT_FOUND"):
        cloud.describe("vm-x", ZONE)
    describes = [c[4] for c in gcloud.calls() if c[3] == "describe"]
    assert [describes.count(name) for name in ("vm-a", "vm-c", "vm-x")] == [2, 3, 1]


def by_topology(name: str, kind: str | None, topology: str | None) -> dict:
    """A node created with ``--type``/``--topology``: no acceleratorType, perhaps an
    acceleratorConfig {type, topology} (TPU API v2 AcceleratorConfig)."""
    node = tpu_node(name, ZONE, "v6e-4", [("10.0.0.5", HOSTS[0])])
    del node["acceleratorType"]
    node.pop("acceleratorConfig")
    if kind:
        node["acceleratorConfig"] = {"type": kind, "topology": topology}
    return node


def test_a_node_without_accelerator_type_is_checked_by_its_accelerator_config(gcloud, tmp_path,
                                                                             v6e4):
    """The launch's targets and the fleet's check agree: acceleratorConfig against the profile's
    topology (v6e:2x2), nothing to compare is no refusal. gcloud is the stand-in."""
    assert [t.host for t in node_targets(by_topology("a", "V6E", "2x2"), "external", v6e4)] \
        == [HOSTS[0]]
    assert len(node_targets(by_topology("a", None, None), "external", v6e4)) == 1
    expected = "TPU b is a V6E 2x4 (acceleratorConfig), hardware=v6e4 is a v6e-4 (v6e:2x2)"
    with pytest.raises(ConfigError, match=re.escape(expected)):
        node_targets(by_topology("b", "V6E", "2x4"), "external", v6e4)
    with pytest.raises(ConfigError, match="TPU c is a V5LITE_POD 2x2 "):
        node_targets(by_topology("c", "V5LITE_POD", "2x2"), "external", v6e4)
    for name, kind, topology in (("a", "V6E", "2x2"), ("b", "V6E", "2x4"), ("n", None, None)):
        gcloud.add(by_topology(name, kind, topology))
    fleet.check_known(Vm("a", fleet_cfg(tmp_path), v6e4), recreate=False)
    fleet.check_known(Vm("n", fleet_cfg(tmp_path), v6e4), recreate=False)
    with pytest.raises(ConfigError, match=re.escape(expected)):
        fleet.check_known(Vm("b", fleet_cfg(tmp_path), v6e4), recreate=False)


def test_a_ready_node_under_maintenance_is_waited_for_not_used_nor_recreated(gcloud, tmp_path,
                                                                             v6e4):
    """state READY with health UNHEALTHY_MAINTENANCE (TPU API Node.health: it resumes once
    rescheduled) is pending: the launch refuses it, the fleet waits, neither deletes it. The
    stand-in replays the health, one describe at a time."""
    node = tpu_node("vm-a", ZONE, "v6e-4", [("10.0.0.5", HOSTS[0])])
    maintenance = {**node, "health": "UNHEALTHY_MAINTENANCE"}
    with pytest.raises(ConfigError, match="TPU vm-a is READY but under maintenance"):
        node_targets(maintenance, "external", v6e4)
    gcloud.add({**maintenance, "x-health": ["UNHEALTHY_MAINTENANCE"] * 5 + ["HEALTHY"]})
    cfg = fleet_cfg(tmp_path)
    recorded = f"{HOSTS[0]} ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIHostKeyOfTheSameVm\n"
    Path(cfg.known_hosts).write_text(recorded)  # the VM's host key, from an earlier launch
    vm = Vm("vm-a", cfg, v6e4, log=print)
    assert (vm.state(), vm.health()) == ("UNHEALTHY_MAINTENANCE", PENDING)
    with pytest.raises(VmLost, match="TPU vm-a is UNHEALTHY_MAINTENANCE"):
        vm.check()
    vm.restore()  # waits through two more maintenance describes (the stand-in counts them)
    assert (vm.state(), vm.health()) == ("READY", UP)
    assert not [c for c in gcloud.calls() if c[3] != "describe"]
    assert len(gcloud.calls()) >= 7
    assert Path(cfg.known_hosts).read_text() == recorded  # the same VM: its key stays trusted


@pytest.mark.parametrize("maintenance_wait_s", [30, 0.2])
def test_a_node_under_maintenance_is_waited_for_up_to_maintenance_wait_s(gcloud, tmp_path, v6e4,
                                                                         maintenance_wait_s):
    """Maintenance lasts longer than a VM takes to come up (hours): while the node says so,
    maintenance_wait_s bounds the wait, not ready_timeout_s."""
    node = tpu_node("vm-a", ZONE, "v6e-4", [("10.0.0.5", HOSTS[0])])
    gcloud.add({**node, "x-health": ["UNHEALTHY_MAINTENANCE"] * 12 + ["HEALTHY"]})
    cfg = fleet_cfg(tmp_path, ready_timeout_s=0.1, maintenance_wait_s=maintenance_wait_s)
    vm = Vm("vm-a", cfg, v6e4, log=print)
    if maintenance_wait_s < 1:
        with pytest.raises(LaunchError, match=r"TPU vm-a is still UNHEALTHY_MAINTENANCE after .*"
                                              r"\(hydra.launcher.maintenance_wait_s=0.2\)"):
            vm.restore()
    else:
        vm.restore()
        assert (vm.state(), vm.health()) == ("READY", UP)
    assert not [c for c in gcloud.calls() if c[3] != "describe"]


def test_an_active_queued_resource_whose_node_is_under_maintenance_is_waited_for(gcloud,
                                                                                 tmp_path, v6e4):
    """A queued resource stays ACTIVE while its node (of the same name) is READY with health
    UNHEALTHY_MAINTENANCE: the fleet reads the node's health and waits, deleting nothing."""
    gcloud.add(queued_resource("qr-a", "v6e-4", "ACTIVE"), queued=True)
    gcloud.add({**tpu_node("qr-a", ZONE, "v6e-4", [("10.0.0.5", HOSTS[0])]),
                "x-health": ["UNHEALTHY_MAINTENANCE"] * 4 + ["HEALTHY"]})
    vm = Vm("qr-a", fleet_cfg(tmp_path, tpu="qr-a", queued=True), v6e4, log=print)
    assert (vm.state(), vm.health()) == ("UNHEALTHY_MAINTENANCE", PENDING)
    with pytest.raises(VmLost, match="TPU qr-a is UNHEALTHY_MAINTENANCE"):
        vm.check()
    vm.restore()  # waits through the node's last maintenance describes
    assert (vm.state(), vm.health()) == ("ACTIVE", UP)
    assert not [c for c in gcloud.calls() if c[3] != "describe"]


def test_a_login_key_that_cannot_be_read_stops_a_recreation_before_the_delete(gcloud, tmp_path,
                                                                              v6e4):
    gcloud.add({**tpu_node("vm-a", ZONE, "v6e-4", [("10.0.0.5", HOSTS[0])]), "state": "PREEMPTED"})
    cfg = fleet_cfg(tmp_path, identity_file=str(tmp_path / "no_such_key"))
    with pytest.raises(ConfigError, match="no_such_key.pub, and ssh-keygen could not derive it"):
        Vm("vm-a", cfg, v6e4).restore()
    assert not [c for c in gcloud.calls() if c[3] != "describe"]  # the VM is still there


def test_a_job_that_stopped_for_its_notice_is_rerun_once_its_vm_goes_down(gcloud, tmp_path, v6e4,
                                                                          monkeypatch):
    """The job answered a preemption notice (checkpoint, exit 143) while its VM still said
    READY; two describes later the VM is PREEMPTED: the fleet recreates it and runs the job
    again. launch_job is stood in for here (its result is what this decision reads; a job's real
    answer to a notice is tested in tests/test_notices.py and the e2e fleet tests)."""
    from xtrain.launcher import fleet

    node = tpu_node("vm-a", ZONE, "v6e-4", [("10.0.0.5", HOSTS[0])])
    gcloud.add({**node, "x-states": ["READY", "READY", "READY", "PREEMPTED"]})
    gcloud.scenario("vm-a", states=["CREATING", "READY"])
    results = iter([{"preempted": True, "step": 12}, {"step": 40, "loss": 1.25}])
    monkeypatch.setattr(fleet, "launch_job", lambda *args, **kwargs: next(results))
    messages = []
    job = fleet.Job(fleet_cfg(tmp_path), v6e4, [], "run", str(tmp_path / "job"))
    result = fleet.run_on_vm(job, log=messages.append)
    assert (result["step"], result["preemptions"]) == (40, 1)
    assert [c[3] for c in gcloud.calls() if c[3] != "describe"] == ["delete", "create"]
    assert any("vm-a is PREEMPTED: job run preempted" in m for m in messages)

    # a stop the VM outlives (a signal sent by hand) is the job's own: no re-run
    gcloud.add(node)
    monkeypatch.setattr(fleet, "VM_DOWN_WAIT_S", 0.3)
    monkeypatch.setattr(fleet, "launch_job", lambda *args, **kwargs: {"preempted": True, "step": 7})
    result = fleet.run_on_vm(fleet.Job(fleet_cfg(tmp_path), v6e4, [], "run", str(tmp_path / "job")),
                             log=messages.append)
    assert (result["step"], result["preempted"], result["preemptions"]) == (7, True, 0)


@pytest.mark.parametrize("state, checkpoint_dir, says", [
    ("PREEMPTED", None, "it does not come back READY by itself: delete it and create it again, "
     "then run the same command (its checkpoints in the run dir on the VM go with the VM's disk, "
     "so it will train from step 0 again (checkpoint.dir=gs://... keeps them)); "
     "hydra.launcher.recreate=true with checkpoint.dir=gs://... does that unattended"),
    ("TERMINATED", "gs://b/ckpt", "delete it and create it again, then run the same command (it "
     "resumes from its newest checkpoint in gs://b/ckpt)"),
    ("NOT_FOUND", "gs://b/ckpt", "it does not come back READY by itself: create it again, then"),
    ("RESTARTING", None, "was preempted; run the same command once the VM is READY"),
])
def test_a_preemption_without_recreate_says_what_brings_the_job_back(
        gcloud, tmp_path, v6e4, monkeypatch, state, checkpoint_dir, says):
    """Without ``recreate``, a preempted VM is the user's to recreate: the error says so (a spot
    VM never turns READY again by itself), and whether the checkpoints outlive it."""
    gcloud.add(tpu_node("vm-a", ZONE, "v6e-4", [("10.0.0.5", HOSTS[0])]))

    def lost(*args, **kwargs):
        raise VmLost("vm-a", state)

    monkeypatch.setattr(fleet, "launch_job", lost)
    job = fleet.Job(fleet_cfg(tmp_path, recreate=False), v6e4, [], "run", str(tmp_path / "job"),
                    checkpoint_dir)
    with pytest.raises(LaunchError) as e:
        fleet.run_on_vm(job, log=print)
    assert str(e.value).startswith(f"TPU vm-a is {state}: job run was preempted; ")
    assert says in str(e.value)
    assert ("READY by itself" in str(e.value)) == (state != "RESTARTING")
    assert [c[3] for c in gcloud.calls() if c[3] != "describe"] == []


def test_each_preempted_attempts_log_is_kept_under_a_name_of_its_own(tmp_path):
    """A later launch of the same command numbers on: its first preemption does not overwrite
    the log an earlier launch kept."""
    job = fleet.Job(None, None, [], "run", str(tmp_path))
    (tmp_path / "worker-0.preempted-1.log").write_text("step    7/60 | loss 3.1\n")
    for attempt, step in (("first", 12), ("second", 30)):
        (tmp_path / "worker-0.log").write_text(f"{attempt}\nstep   {step}/60 | loss 2.5 |\n")
        history = fleet.Preemptions()
        history.record(VmLost("vm-a", "PREEMPTED"), job)
        assert history.steps_seen == step
    assert [(tmp_path / f"worker-0.preempted-{n}.log").read_text().split()[0]
            for n in (1, 2, 3)] == ["step", "first", "second"]


def test_every_workers_log_of_a_preempted_attempt_is_kept(tmp_path):
    """A pod's preempted attempt: each worker's log is kept aside (the re-run starts every log
    afresh, and the VM with the workers' own copies is gone)."""
    job = fleet.Job(None, None, [], "run", str(tmp_path))
    workers = (0, 1, 3, 12)  # (2's copy of its log never began: the others are kept all the same)
    for i in workers:
        (tmp_path / f"worker-{i}.log").write_text(f"worker {i}\nstep    7/60 | loss 3.1 |\n")
    fleet.Preemptions().record(VmLost("vm-a", "PREEMPTED"), job)
    assert [(tmp_path / f"worker-{i}.preempted-1.log").read_text().split()[:2]
            for i in workers] == [["worker", str(i)] for i in workers]
    assert not any((tmp_path / f"worker-{i}.log").exists() for i in workers)


@pytest.mark.parametrize("case", ["preempted", "gcloud silent"])
def test_a_vm_that_changed_since_the_fleet_looked_is_no_refused_input(gcloud, remote, tmp_path,
                                                                      tpu_profile, case):
    """The fleet found the VM READY, then the launch's own describe finds it PREEMPTED, or gets no
    answer from gcloud (its auth-token refresh failing, after the launch's waits): a preemption,
    or a failed launch, not a refused config (which ended a pool's sweep with exit 2)."""
    states = ["PREEMPTED"] if case == "preempted" else ["ANSWERLESS"]
    gcloud.add({**tpu_node("vm-b", ZONE, "v6e-4", [(HOSTS[1], HOSTS[1])]), "x-states": states})
    cfg = loopback_cfg(remote, tmp_path, hosts=[], pool=["vm-b"])
    job = Job(cfg, tpu_profile, [], "job-0", str(tmp_path / "job-0"))
    with pytest.raises(LaunchError) as e:  # (raised before anything reaches the worker)
        fleet.attempt(Vm("vm-b", cfg, tpu_profile), job, fleet.Preemptions(), log=print)
    if case == "preempted":
        assert isinstance(e.value, VmLost) and e.value.state == "PREEMPTED"
    else:
        assert not isinstance(e.value, VmLost), e.value
        assert "gcloud could not describe TPU 'vm-b'" in str(e.value)
        assert str(e.value).endswith("(asked again: NO_ANSWER)")


def probes(*states, attempt=None):
    """What launch_job's probes say of the job on each worker (jobs/<job>/ state, attempt and
    command digest; a job never started there has none of them)."""
    return [SimpleNamespace(job=JobState(s, None, False, attempt, 0, attempt and "c0ffee"))
            for s in states]


@pytest.mark.parametrize("case", ["first launch", "run dir on the VM", "on GCS", "a local dir",
                                  "still on the workers", "a start that failed there",
                                  "a named checkpoint"])
def test_a_job_that_ran_before_on_workers_that_lost_it_is_said_to_start_over(tmp_path, case):
    """A relaunch whose workers hold no trace of the job's earlier attempt (a recreated VM, another
    VM of a pool): with its checkpoints in the run dir on the VM, they are gone and it trains from
    step 0 again, under a new W&B run id (W&B drops the steps a resumed run logs out of order)."""
    from xtrain.launcher.jobdir import identity_env
    from xtrain.observe.wandb_run import RUN_ID_ENV

    (tmp_path / "wandb-run-id").write_text("aaaabbbbcccc")
    if case != "first launch":
        (tmp_path / "launch.json").write_text(
            '{"job": "run", "attempt": "20261130-1", "hosts": ["10.0.0.5"]}')
        (tmp_path / "worker-0.preempted-1.log").write_text("step   40/90 | loss 2.5 |\n")
        (tmp_path / "worker-0.log").write_text("step   20/90 | loss 2.9 |\nsaved\n")
    checkpoint_dir = {"on GCS": "gs://b/run", "a local dir": "/mnt/disk/ckpt"}.get(case)
    states = ("exited", "none") if case == "still on the workers" else ("none", "none")
    found = probes(*states, attempt="20261130-2" if case == "a start that failed there" else None)
    messages = []
    named = ["checkpoint.resume='gs://b/run/step_000040'"] if case == "a named checkpoint" else []
    env = identity_env(str(tmp_path), found, checkpoint_dir, ["model=d2", *named], messages.append)
    stored = (tmp_path / "wandb-run-id").read_text()
    assert env == {RUN_ID_ENV: stored}
    ran = ("launch: warning: job run ran before on 10.0.0.5 (attempt 20261130-1, step 40 "
           "logged), and these workers hold no trace of it (a new VM's disk?)")
    if case == "run dir on the VM":
        assert stored != "aaaabbbbcccc" and re.fullmatch(r"[0-9a-f]{12}", stored)
        assert messages == [f"{ran}: its checkpoints were in the run dir on that VM, so it trains "
                            "from step 0 again, as a new W&B run; checkpoint.dir=gs://... keeps "
                            "checkpoints across VMs"]
    elif case == "a local dir":  # maybe a disk that outlived the VM: said, the W&B run kept
        assert stored == "aaaabbbbcccc"
        assert messages == [f"{ran}: unless checkpoint.dir=/mnt/disk/ckpt is on a disk that "
                            "outlived that VM, it trains from step 0 again; checkpoint.dir=gs://"
                            "... keeps checkpoints across VMs"]
    else:
        assert stored == "aaaabbbbcccc" and messages == []


def test_a_vm_takes_the_job_already_on_it_first_and_leaving_keeps_its_reason():
    queue = JobQueue(3, placed={2: "vm-a"}, vms=2)
    assert queue.take("vm-a") == 2  # jobs 0 and 1 would find vm-a busy with job 2
    assert queue.take("vm-a") == 0
    assert queue.leave("vm-b", "TPU vm-b: it is PREEMPTED") == ([], [])
    assert queue.reasons == ["TPU vm-b: it is PREEMPTED"]


@pytest.mark.parametrize("up", [True, False])
def test_a_vm_that_leaves_up_keeps_the_jobs_placed_on_it_from_the_others(up):
    """Left up (a notice, a refusal), a VM still holds the checkpoints (or the run) of the jobs
    placed on it: no other VM may run them (from step 0, or a second time). Left down
    (preempted), its disk is gone: any VM runs them."""
    queue = JobQueue(3, placed={1: "vm-a"}, vms=2)
    assert queue.take("vm-b") == 0
    assert queue.leave("vm-a", "TPU vm-a: it refused", up=up) == (([1], []) if up else ([], []))
    queue.finish(0)
    assert queue.take("vm-b") == (2 if up else 1)


def test_the_queue_gives_requeued_jobs_first_and_placed_jobs_to_their_vm():
    queue = JobQueue(3, placed={2: "vm-b"}, vms=2)
    assert queue.take("vm-a") == 0
    assert queue.take("vm-a") == 1  # job 2 runs on vm-b already: only vm-b reattaches it
    assert queue.take("vm-b") == 2
    queue.finish(0, requeue=True)  # vm-a was preempted under job 0
    assert queue.take("vm-b") == 0
    got = []
    waiter = threading.Thread(target=lambda: got.append(queue.take("vm-a")))
    waiter.start()
    time.sleep(0.2)
    assert waiter.is_alive()  # jobs are in flight and may come back: vm-a waits
    assert queue.leave("vm-b") == ([], [])  # vm-a is still there
    for job in (1, 2, 0):
        queue.finish(job)
    waiter.join(5)
    assert got == [None]
    lonely = JobQueue(2, {}, vms=1)
    assert lonely.take("vm-a") == 0
    lonely.finish(0, requeue=True)
    assert lonely.leave("vm-a") == ([], [0, 1])  # nobody is left to run them


def test_the_summary_table_shows_every_job():
    table = summary([("d2-a", "vm-a", {"loss": 5.12345}, "finished", 1, 95.0),
                     ("d2-b", None, None, "failed", 0, 0.0)]).splitlines()
    assert table[0].split() == ["job", "VM", "final", "loss", "state", "preemptions", "time", "lost"]
    assert table[1].split() == ["d2-a", "vm-a", "5.1235", "finished", "1", "1m35s"]
    assert table[2].split() == ["d2-b", "-", "-", "failed", "0", "0m00s"]


def test_a_rerun_records_its_preemptions_in_its_metrics():
    env = preemptions.launch_env(2, 130.04, 23)
    assert env == {"XTRAIN_PREEMPTIONS": "2", "XTRAIN_TIME_LOST_S": "130.0", "XTRAIN_STEPS_SEEN": "23"}
    assert preemptions.record(20, env) == {"step": 20, "preemptions": 2, "time_lost_s": 130.0,
                                           "steps_redone": 3}
    assert preemptions.record(20, {}) is None  # a first run records nothing


def cli(*args, env=None, tmp_path):
    launch = ROOT / "launch"
    full = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(launch)]), **(env or {}))
    full.pop("HYDRA_FULL_ERROR", None)
    return subprocess.run([sys.executable, "-m", "xtrain", *args], cwd=tmp_path, env=full,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("case", ["local checkpoints", "unknown pool entry", "pod profile in a pool",
                                  "unknown tpu", "a login key ssh-keygen cannot read", "no target",
                                  "no gcloud", "secret in the job's env", "forwarded secret in the job's env",
                                  "gcloud cannot answer"])
def test_bad_fleet_input_is_refused_before_anything_is_touched(gcloud, tmp_path, case):
    gcloud.add(tpu_node("vm-a", ZONE, "v6e-4", [("10.0.0.5", HOSTS[0])]))
    gcloud.add(tpu_node("vm-b", ZONE, "v6e-4", [("10.0.0.6", HOSTS[1])]))
    # every describe fails, as gcloud's does when it cannot refresh its auth token
    gcloud.add({**tpu_node("vm-c", ZONE, "v6e-4", [("10.0.0.7", HOSTS[0])]),
                "x-states": ["ANSWERLESS"]})
    remote = tmp_path / "remote"
    identity = fleet_cfg(tmp_path).identity_file  # a placeholder pair: never used to log in
    if case == "no target":  # said before the missing key
        identity = str(tmp_path / "no_such_key")
    if case == "a login key ssh-keygen cannot read":  # a file, not a key, without its public half
        identity = str(tmp_path / "not_a_key")
        Path(identity).write_text("not a key\n")
        os.chmod(identity, 0o644)  # readable by others: ssh-keygen's banner comes first
    base = [*TINY, "run.name=fleet-bad", "hydra/launcher=tpu_vm", f"hydra.launcher.zone={ZONE}",
            f"hydra.launcher.remote_dir='{remote}/{{host}}'", f"hydra.launcher.identity_file={identity}"]
    multirun, env = [], None
    if case == "no target":
        args, expected = ["hardware=v6e4"], "hydra.launcher.tpu=NAME (with zone) or hydra.launcher"
    elif case == "no gcloud":  # a PATH of the venv alone: no gcloud (nor its stand-in) on it
        args, env = ["hardware=v6e4", "hydra.launcher.tpu=vm-a"], {"PATH": str(Path(sys.executable).parent)}
        expected = "environment error: gcloud is not on PATH"
    elif case == "secret in the job's env":  # it would be written, resolved, into the run script
        args = ["hardware=v6e4", "hydra.launcher.tpu=vm-a", "+hydra.launcher.env.HF_LOGIN=${oc.env:XTRAIN_TEST_LOGIN}"]
        env = {"XTRAIN_TEST_LOGIN": "hf_" + "Xy9" * 11}
        expected = "hydra.launcher.env.HF_LOGIN: a secret is never written into a config"
    elif case == "forwarded secret in the job's env":  # a secret by hydra.launcher.secrets alone
        args = ["hardware=v6e4", "hydra.launcher.tpu=vm-a", "hydra.launcher.secrets=[XTRAIN_TEST_LOGIN]",
                "+hydra.launcher.env.HUB=${oc.env:XTRAIN_TEST_LOGIN}"]
        env = {"XTRAIN_TEST_LOGIN": "Zq7mK2pX" + "9vL4nR8tY3wB6cF1"}
        expected = "hydra.launcher.env.HUB: a secret is never written into a config"
    elif case == "local checkpoints":
        args = ["hardware=v6e4", "hydra.launcher.tpu=vm-a", "hydra.launcher.recreate=true"]
        expected = "hydra.launcher.recreate=true needs checkpoint.dir=gs://..."
    elif case == "unknown pool entry":
        multirun, args = ["-m"], ["optim.matrix_lr=0.01,0.02", "hydra.launcher.pool=[vm-a,vm-x]",
                                  "run.name=fleet-bad-${optim.matrix_lr}"]  # (a name per job)
        expected = f"gcloud does not know TPU vm-x in {ZONE}"
    elif case == "pod profile in a pool":
        multirun, args = ["-m"], ["hardware=v4_32", "hydra.launcher.pool=[vm-a,vm-b]"]
        expected = "pools are single-host TPU VMs"
    elif case == "gcloud cannot answer":  # refused (exit 2) with recreate as without it
        args = ["hardware=v6e4", "hydra.launcher.tpu=vm-c", "hydra.launcher.recreate=true",
                "checkpoint.dir=gs://bucket/ckpt"]
        expected = (f"gcloud could not describe TPU 'vm-c' in {ZONE}: ERROR: (gcloud.compute.tpus."
                    "tpu-vm.describe) There was a problem refreshing your current auth tokens")
    elif case == "unknown tpu":
        args = ["hardware=v6e4", "hydra.launcher.tpu=vm-typo", "hydra.launcher.recreate=true",
                "checkpoint.dir=gs://bucket/ckpt"]
        expected = f"gcloud does not know TPU vm-typo in {ZONE}"
    else:  # a recreated VM gets the login key's public half: unreadable, it is refused up front
        args = ["hardware=v6e4", "hydra.launcher.tpu=vm-a", "hydra.launcher.recreate=true",
                "checkpoint.dir=gs://bucket/ckpt"]
        expected = (f"hydra.launcher.identity_file={identity}: no {identity}.pub, and ssh-keygen "
                    f'could not derive it: Load key "{identity}": bad permissions')
    r = cli(*multirun, *base, *args, env=env, tmp_path=tmp_path)
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
    assert expected in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not remote.exists()  # nothing copied, no directory made
    assert not [c for c in gcloud.calls() if c[3] in ("create", "delete")]


@pytest.fixture
def tpu_profile(compose_config):
    """A v6e-4 to the launcher (what gcloud describes), CPU for anything that would train: the
    loopback "VMs" have no TPU."""
    return compose_config(["hardware=cpu", "hardware.accelerator_type=v6e-4",
                           "hardware.runtime_version=v2-alpha-tpuv6e"]).hardware


def loopback_cfg(remote, tmp_path, **fields):
    """Launcher fields for the loopback hosts of tests/sshd.py (gcloud's stand-in names them)."""
    fields = {"zone": ZONE, "poll_s": 0.05, "tpu_lockfile": str(tmp_path / "libtpu_lockfile"),
              **fields}
    return OmegaConf.structured(LauncherConfig(**remote.launcher_fields(**fields)))


@contextlib.contextmanager
def another_job(remote, host):
    """Another sweep's job running on ``host`` (a sleeper leading its own process group)."""
    other = remote.root(host) / "jobs" / "pool-other"
    other.mkdir(parents=True, exist_ok=True)
    sleeper = subprocess.Popen(["sleep", "120"], start_new_session=True)
    try:
        (other / "pid").write_text(f"{sleeper.pid}\n")
        yield sleeper.pid
    finally:
        sleeper.kill()
        sleeper.wait()
        shutil.rmtree(other)


@pytest.mark.parametrize("case", ["TPU in use", "unreachable"])
def test_a_refusal_before_the_job_starts_is_the_vms(remote, tmp_path, tpu_profile, case):
    """What launch_job refuses before anything of the job runs is a VmUnavailable (the pool gives
    the job to another VM); a busy worker is the pool test below."""
    if case == "unreachable":  # nothing listens on 127.0.0.4
        cfg, expected = loopback_cfg(remote, tmp_path, hosts=["127.0.0.4"], retries=0), \
            "127.0.0.4:.* unreachable after 1 attempts"
        holder = None
    else:  # libtpu's lock held open by another program (tests/test_launch_ssh.py for the script)
        cfg = loopback_cfg(remote, tmp_path, hosts=[HOSTS[1]])
        lock = tmp_path / "libtpu_lockfile"
        lock.write_text("")
        with open(lock) as f:
            holder = subprocess.Popen(["sleep", "120"], stdin=f)
        expected = re.escape(f"the TPU is in use: process {holder.pid} holds {lock}")
    try:
        with pytest.raises(VmUnavailable, match=expected):
            launch_job(cfg, tpu_profile, [], "pool-refused", str(tmp_path / "job"))
    finally:
        if holder:
            holder.kill()
            holder.wait()
    if case == "TPU in use":  # refused by the start script, before the job's wrapper ran
        assert not (remote.root(HOSTS[1]) / "jobs" / "pool-refused" / "pid").exists()


def test_a_vm_that_refuses_jobs_leaves_the_pool_and_the_others_run_them(
        gcloud, remote, tmp_path, tpu_profile, monkeypatch):
    """vm-a is busy with another sweep's job: the real launch_job refuses there over ssh. vm-b's
    jobs are stood in for (0.2 s each; the refusal, not training, is tested here), one of them
    failing as its own failure. vm-a leaves the pool once, saying why; every job runs on vm-b.
    Once every VM is busy, the jobs fail naming each VM's reason."""
    gcloud.add(tpu_node("vm-a", ZONE, "v6e-4", [(HOSTS[0], HOSTS[0])]))
    gcloud.add(tpu_node("vm-b", ZONE, "v6e-4", [(HOSTS[1], HOSTS[1])]))
    real = fleet.launch_job

    def launch(cfg, hardware, overrides, run_name, *args, **kwargs):
        if cfg.tpu == "vm-a":
            return real(cfg, hardware, overrides, run_name, *args, **kwargs)
        time.sleep(0.2)
        if run_name == "job-3":
            raise LaunchError(f"worker 0 ({HOSTS[1]}) failed (exit code 1)")
        return {"loss": 2.0}

    monkeypatch.setattr(fleet, "launch_job", launch)
    cfg = loopback_cfg(remote, tmp_path, hosts=[], pool=["vm-a", "vm-b"])
    jobs = [Job(cfg, tpu_profile, [], f"job-{i}", str(tmp_path / f"job-{i}")) for i in range(5)]
    messages = []
    with another_job(remote, HOSTS[0]) as pid:
        outcomes = run_pool(jobs, log=messages.append)
        assert [(o.vm, o.state) for o in outcomes] == [("vm-b", "finished")] * 3 + [
            ("vm-b", "failed"), ("vm-b", "finished")]
        assert "exit code 1" in str(outcomes[3].error)  # started, then failed: the job's own
        left = [m for m in messages if "leaves the pool" in m]
        assert len(left) == 1, messages
        assert re.match(r"\[vm-a\] fleet: TPU vm-a leaves the pool: it refused job job-\d before "
                        r"starting it: another xtrain job is running there: worker 0 "
                        rf"\({HOSTS[0]}\): pool-other pid {pid} ", left[0]), left[0]
        assert not list((remote.root(HOSTS[0]) / "jobs").glob("job-*"))  # nothing copied there

        with another_job(remote, HOSTS[1]):
            monkeypatch.setattr(fleet, "launch_job", real)
            outcomes = run_pool(jobs[:3], log=messages.append)
    for o, job in zip(outcomes, jobs[:3], strict=True):  # one outcome per job asked
        assert (o.vm, o.state) == (None, "failed")
        assert str(o.error).startswith(f"job {job.run_name}: no VM of the pool is left to run "
                                       "it: TPU vm-")
        assert "TPU vm-a: it refused job" in str(o.error)
        assert "TPU vm-b: it refused job" in str(o.error)


def test_a_pool_job_is_not_failed_for_a_describe_gcloud_fails(gcloud, remote, tmp_path,
                                                               tpu_profile, monkeypatch):
    """A describe of the stand-in fails (gcloud's auth-token refresh error) as vm-b is about to
    take job-0, and again after job-1 failed: job-0 runs anyway (its launch asks the worker), and
    job-1's failure stays its own, not the gcloud error nor a preemption. The jobs are stood in
    for (their outcome, not training, is tested here)."""
    # describes: check_known's two, locate's two, then serve's before job-0, serve's before
    # job-1 and attempt's after it
    vm_b = tpu_node("vm-b", ZONE, "v6e-4", [(HOSTS[1], HOSTS[1])])
    gcloud.add({**vm_b, "x-states": ["READY"] * 4 + ["ANSWERLESS", "READY", "ANSWERLESS",
                                                     "READY"]})

    def launch(cfg, hardware, overrides, run_name, *args, **kwargs):
        if run_name == "job-1":
            raise LaunchError(f"worker 0 ({HOSTS[1]}) failed (exit code 1)")
        return {"loss": 2.0}

    monkeypatch.setattr(fleet, "launch_job", launch)
    cfg = loopback_cfg(remote, tmp_path, hosts=[], pool=["vm-b"])
    jobs = [Job(cfg, tpu_profile, [], f"job-{i}", str(tmp_path / f"job-{i}")) for i in range(2)]
    outcomes = run_pool(jobs, log=print)
    assert [(o.vm, o.state) for o in outcomes] == [("vm-b", "finished"), ("vm-b", "failed")]
    assert outcomes[0].result["loss"] == 2.0
    assert "exit code 1" in str(outcomes[1].error) and outcomes[1].history.count == 0


@pytest.mark.parametrize("case", ["refused", "under maintenance", "being created"])
def test_a_job_placed_on_a_vm_that_leaves_up_fails_naming_it_not_run_elsewhere(
        gcloud, remote, tmp_path, tpu_profile, monkeypatch, case):
    """Job 0 is placed on vm-a (its checkpoints on vm-a's disk, or still running there). vm-a
    refuses it before starting it (busy, its TPU held), or is found under maintenance (it comes
    back with its disk): vm-a leaves the pool up, and job 0 fails naming it; on vm-b it would
    train from step 0 again, or run twice. A VM being created holds no disk of before: its job
    goes to vm-b. Launches are stood in for (where jobs go, not training, is tested here)."""
    node = tpu_node("vm-a", ZONE, "v6e-4", [(HOSTS[0], HOSTS[0])],
                    state="CREATING" if case == "being created" else "READY")
    if case == "under maintenance":
        node["health"] = "UNHEALTHY_MAINTENANCE"
    gcloud.add(node)

    def refused(cfg, hardware, overrides, run_name, *args, **kwargs):
        raise VmUnavailable(f"another xtrain job is running there: worker 0 ({HOSTS[0]})")

    monkeypatch.setattr(fleet, "launch_job", refused)
    cfg = loopback_cfg(remote, tmp_path, hosts=[], pool=["vm-a", "vm-b"], recreate=False)
    jobs = [Job(cfg, tpu_profile, [], f"job-{i}", str(tmp_path / f"job-{i}")) for i in range(2)]
    queue, outcomes = JobQueue(2, placed={0: "vm-a"}, vms=2), [Outcome() for _ in jobs]
    serve(Vm("vm-a", cfg, tpu_profile, log=print), jobs, queue, outcomes)  # returns as it leaves
    if case == "being created":
        assert outcomes[0].error is None and queue.take("vm-b") == 0
        return
    assert str(outcomes[0].error).startswith("job job-0: not run: it runs on TPU vm-a, or its "
                                             "checkpoints are on that VM's disk, and TPU vm-a "
                                             "left the pool ("), outcomes[0].error
    assert queue.take("vm-b") == 1 and queue.pending == deque()


def test_a_pool_stop_stops_the_job_where_it_runs_past_a_vm_that_is_down(gcloud, remote, tmp_path,
                                                                       tpu_profile):
    """hydra.launcher.stop=true over pool=[vm-a, vm-b], vm-a PREEMPTED (the stand-in's), the job
    running on vm-b: it is stopped there, then the stop fails naming vm-a (the refusal of vm-a
    ended the stop before vm-b was asked)."""
    from xtrain.launcher.hydra_jobs import stop

    gcloud.add(tpu_node("vm-a", ZONE, "v6e-4", [(HOSTS[0], HOSTS[0])], state="PREEMPTED"))
    gcloud.add(tpu_node("vm-b", ZONE, "v6e-4", [(HOSTS[1], HOSTS[1])]))
    running = remote.root(HOSTS[1]) / "jobs" / "pool-stop"
    running.mkdir(parents=True)
    sleeper = subprocess.Popen(["sleep", "120"], start_new_session=True)
    try:
        (running / "pid").write_text(f"{sleeper.pid}\n")
        cfg = loopback_cfg(remote, tmp_path, hosts=[], pool=["vm-a", "vm-b"], stop=True)
        with pytest.raises(LaunchError, match=r"job pool-stop: stopped where it ran, not every VM "
                                              r"of the pool could be asked: TPU vm-a: .*PREEMPTED"):
            stop(Job(cfg, tpu_profile, [], "pool-stop", str(tmp_path / "job")))
        assert sleeper.wait(timeout=30) == -signal.SIGTERM
    finally:
        sleeper.kill()
        shutil.rmtree(running)


def ended_unwatched(remote, host, job: str) -> None:
    """What a job of an earlier launch leaves on ``host`` when it ended with nobody watching: an
    exit code, no ``reported`` mark, its log and its metrics."""
    done = subprocess.Popen(["true"])
    done.wait()
    jobs, run = remote.root(host) / "jobs" / job, remote.root(host) / "runs" / job
    jobs.mkdir(parents=True)
    run.mkdir(parents=True)
    for name, text in {"pid": f"{done.pid}\n", "exit": "0\n", "attempt": "a1\n",
                       "log": "step    10/10 | loss 2.5000\n"}.items():
        (jobs / name).write_text(text)
    (run / "metrics.jsonl").write_text('{"step": 10, "loss": 2.5}\n')


def test_a_pool_job_that_ended_unwatched_is_reported_where_it_ran(gcloud, remote, tmp_path,
                                                                  tpu_profile, monkeypatch):
    """Both jobs of the sweep ended on vm-b while nobody watched: the relaunch reattaches each
    there and reports its end (real launch_job over ssh); free vm-a starts nothing."""
    from xtrain.launcher import launch

    def started_afresh(worker, *args):
        raise AssertionError(f"a job was set up to start afresh on {worker}")

    monkeypatch.setattr(launch, "prepare", started_afresh)
    gcloud.add(tpu_node("vm-a", ZONE, "v6e-4", [(HOSTS[0], HOSTS[0])]))
    gcloud.add(tpu_node("vm-b", ZONE, "v6e-4", [(HOSTS[1], HOSTS[1])]))
    cfg = loopback_cfg(remote, tmp_path, hosts=[], pool=["vm-a", "vm-b"])
    names = ["pool-unwatched-0", "pool-unwatched-1"]  # the first through the probe's own job
    jobs = [Job(cfg, tpu_profile, [], name, str(tmp_path / name)) for name in names]
    messages = []
    try:
        for name in names:
            ended_unwatched(remote, HOSTS[1], name)
        outcomes = run_pool(jobs, log=messages.append)
        assert [(o.vm, o.state, o.error) for o in outcomes] == [("vm-b", "finished", None)] * 2
        assert all(o.result["loss"] == 2.5 for o in outcomes)
        for name in names:
            assert f"[vm-b] launch: job {name} (attempt a1) is already on the workers: " \
                   "reattaching" in messages
            assert (remote.root(HOSTS[1]) / "jobs" / name / "reported").exists()
            assert "loss 2.5000" in (tmp_path / name / "worker-0.log").read_text()
        assert not list((remote.root(HOSTS[0]) / "jobs").glob("pool-unwatched-*"))
    finally:
        for name in names:
            for kind in ("jobs", "runs"):
                shutil.rmtree(remote.root(HOSTS[1]) / kind / name, ignore_errors=True)


def test_a_pool_job_that_ran_before_goes_back_to_the_vm_with_its_checkpoints(
        gcloud, remote, tmp_path, tpu_profile):
    """A sweep run again (a longer trainer.max_steps, mode=eval...) after its jobs ended and were
    reported: each job goes to the VM it ran on, whose disk holds its checkpoints; on both VMs, to
    the one holding the attempt its launch.json names (whatever address reached it); with
    checkpoints in a bucket, anywhere. The probes are real (ssh to the loopback hosts)."""
    gcloud.add(tpu_node("vm-a", ZONE, "v6e-4", [(HOSTS[0], HOSTS[0])]))
    gcloud.add(tpu_node("vm-b", ZONE, "v6e-4", [(HOSTS[1], HOSTS[1])]))
    cfg = loopback_cfg(remote, tmp_path, hosts=[], pool=["vm-a", "vm-b"])
    names = ["pool-ran-0", "pool-ran-1", "pool-ran-2"]  # the first through the probe's own job
    jobs = [Job(cfg, tpu_profile, [], name, str(tmp_path / name)) for name in names]
    vms = [Vm(name, cfg, tpu_profile) for name in cfg.pool]
    traces = [(HOSTS[1], names[0]), (HOSTS[1], names[1]), (HOSTS[0], names[1])]
    try:
        for host, name in traces:
            ended_unwatched(remote, host, name)
            (remote.root(host) / "jobs" / name / "reported").write_text("")
        (remote.root(HOSTS[0]) / "jobs" / names[1] / "attempt").write_text("a0\n")  # the older
        messages = []
        assert locate(vms, jobs, log=messages.append) == {0: "vm-b", 1: "vm-a"}  # pool order
        assert (f"fleet: job {names[0]} ran on TPU vm-b before, and its checkpoints are on that "
                "VM's disk: it runs there again") in messages
        assert (f"fleet: job {names[1]} ran on TPU vm-a, TPU vm-b, none of them its latest attempt "
                "(not recorded here): the first is taken") in messages
        os.makedirs(jobs[1].job_dir)  # its latest attempt, a1, reached vm-b by another address
        record_attempt(jobs[1].job_dir, names[1], "a1", [SimpleNamespace(host="10.0.0.9")],
                       "jobs", "runs")
        assert locate(vms, jobs, log=print) == {0: "vm-b", 1: "vm-b"}
        in_bucket = [dataclasses.replace(j, checkpoint_dir="gs://bucket/ckpt") for j in jobs]
        assert locate(vms, in_bucket, log=print) == {}
    finally:
        for host, name in traces:
            for kind in ("jobs", "runs"):
                shutil.rmtree(remote.root(host) / kind / name, ignore_errors=True)
