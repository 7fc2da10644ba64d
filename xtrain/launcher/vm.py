"""One TPU VM (or queued resource) by name, through gcloud: its state, read from the TPU API's
state tables (:func:`vm_health`: usable, coming up by itself, or down), and its recreation
(:meth:`Vm.restore`). What to do when a job's VM goes down is xtrain/launcher/fleet.py's."""

from __future__ import annotations

import time
from pathlib import Path

from xtrain.launcher.gcloud import Gcloud, NoCapacity, NoVerdict
from xtrain.launcher.launch import say
from xtrain.launcher.runner import LaunchError, Runner
from xtrain.launcher.ssh import Ssh
from xtrain.launcher.targets import MAINTENANCE, node_state, node_targets
from xtrain.train.notices import upcoming_maintenance

UP, PENDING, DOWN = "up", "pending", "down"
NOT_FOUND = "NOT_FOUND"  # gcloud does not know the name (deleted)
NO_ANSWER = "NO_ANSWER"  # gcloud could not answer (a token refresh, a network blip): no verdict
# TPU API v2 Node.State (cloud.google.com/tpu/docs/reference/rest/v2/projects.locations.nodes):
# READY is usable, these come up by themselves; every other state (PREEMPTED, TERMINATED,
# STOPPED, STOPPING, DELETING, HIDDEN, UNKNOWN, ...) means the node must be deleted and recreated.
# A READY node whose Node.health is UNHEALTHY_MAINTENANCE is not usable yet, and resumes by itself
# once rescheduled: Vm.state reports it as that (targets.node_state).
NODE_STATES = {"READY": UP, "CREATING": PENDING, "STARTING": PENDING, "RESTARTING": PENDING,
               "REIMAGING": PENDING, "REPAIRING": PENDING, "UNHIDING": PENDING,
               MAINTENANCE: PENDING}
# QueuedResourceState.State: ACTIVE is usable, these are on their way; SUSPENDED (preempted) and
# FAILED (no capacity in time) must be deleted and created again; SUSPENDING (being taken down by
# the service, a state the TPU API's delete does not mention) and DELETING once they are out
# (Vm.restore waits for them).
QUEUED_STATES = {"ACTIVE": UP, "CREATING": PENDING, "ACCEPTED": PENDING, "PROVISIONING": PENDING,
                 "WAITING_FOR_RESOURCES": PENDING, MAINTENANCE: PENDING}  # (its node's health)
# The states of a VM coming back with the disk it had (a node being created, reimaged or
# provisioned has none of it)
DISK_KEPT = {MAINTENANCE, "STARTING", "RESTARTING"}


def vm_health(state: str, queued: bool = False) -> str:
    """UP (a job can run there), PENDING (coming up by itself) or DOWN (preempted, failed or
    gone: any job there is lost, and the VM must be recreated)."""
    return (QUEUED_STATES if queued else NODE_STATES).get(state, DOWN)


class VmLost(LaunchError):
    """The job's VM is no longer READY: a preemption, not a failure of the job. ``seen_at``: when
    the job was lost (default now; the job's own stop, when it stopped before its VM went)."""

    def __init__(self, vm: str, state: str, seen_at: float | None = None, why: str = ""):
        self.why = why or f"is {state}"
        super().__init__(f"TPU {vm} {self.why}")
        self.vm, self.state, self.seen_at = vm, state, seen_at or time.monotonic()


def clock(seconds: float) -> str:
    m, s = divmod(int(round(seconds)), 60)
    return f"{m // 60}h{m % 60:02d}m{s:02d}s" if m >= 60 else f"{m}m{s:02d}s"


LOGIN_POLL_S = 5.0  # between login attempts while a new VM's keys are not in place


class Vm:
    """One TPU VM (or queued resource) by name, through gcloud: its state, and its recreation."""

    def __init__(self, name: str, cfg, hardware, runner: Runner | None = None, log=say):
        self.name, self.cfg, self.hardware, self.log = name, cfg, hardware, log
        self.runner = runner or Runner()
        self.gcloud = Gcloud(self.runner)

    def __repr__(self) -> str:
        return f"TPU {self.name}"

    @property
    def deletion_mark(self) -> Path:
        """Where the launcher notes this VM while it is deleted for a recreation and not created
        again (no capacity in time, or the launch stopped): gcloud then no longer knows the name,
        and the note tells a later launch that it names a VM xtrain deleted, not a misspelling.
        Kept beside xtrain's known_hosts."""
        where = f"{self.cfg.project or 'default'}.{self.cfg.zone}.{self.name}"
        return Path(self.cfg.known_hosts).expanduser().parent / "deleted-tpus" / where

    def deleted_at(self) -> str | None:
        """When xtrain deleted the VM and has not created it since (the note's time), else None."""
        try:
            return self.deletion_mark.read_text().strip() or "an unknown time"
        except OSError:
            return None

    def _delete(self) -> None:
        self.deletion_mark.parent.mkdir(parents=True, exist_ok=True)
        self.deletion_mark.write_text(time.strftime("%Y-%m-%d %H:%M:%S %Z") + "\n")
        self.gcloud.delete(self.name, self.cfg.zone, self.cfg.project, self.cfg.queued)

    def describe(self) -> dict | None:
        return self.gcloud.find(self.name, self.cfg.zone, self.cfg.project, self.cfg.queued)

    def state(self) -> str:
        found = self.describe()
        if found is None:
            return NOT_FOUND
        if not self.cfg.queued:
            return node_state(found)
        state = found.get("state", "UNKNOWN")
        state = state.get("state", "UNKNOWN") if isinstance(state, dict) else state  # nested
        if state != "ACTIVE":
            return state
        # an ACTIVE resource's node (of the same name) carries the health: under maintenance it
        # is no more usable than a node of its own
        node = self.gcloud.find(self.name, self.cfg.zone, self.cfg.project)
        return MAINTENANCE if node is not None and node_state(node) == MAINTENANCE else state

    def wait_out_maintenance(self, lead_s: float, needed=lambda: True) -> None:
        """After a job stopped for a GCE notice on this VM, which stayed up: wait while gcloud
        shows the node's maintenance (TPU API v2 ``Node.upcomingMaintenance``, judged as the
        job's own watcher judges the metadata server's: under way, or a window starting within
        ``lead_s`` and not ended) or the node under it (health UNHEALTHY_MAINTENANCE), at most
        ``maintenance_wait_s`` and while ``needed()`` (a pool with no job left needs no VM). A
        job started inside a window (hours) would stop again at once. A node down or gone is
        :meth:`restore`'s. A gcloud that cannot answer ends the wait before anything was
        announced, and is asked again after."""
        t0, announced = time.monotonic(), None
        while (waited := time.monotonic() - t0) < self.cfg.maintenance_wait_s and needed():
            try:
                node = self.gcloud.find(self.name, self.cfg.zone, self.cfg.project)
            except LaunchError as e:
                if announced is None:
                    self.log(f"fleet: {self}: {e}; its maintenance unknown, not waited for")
                    return
                time.sleep(self.cfg.poll_s)  # no verdict: asked again
                continue
            state = NOT_FOUND if node is None else node_state(node)
            if state not in ("READY", MAINTENANCE):
                return
            reason = (f"health {MAINTENANCE}" if state == MAINTENANCE else
                      upcoming_maintenance(node.get("upcomingMaintenance"), lead_s))
            if reason is None:
                if announced:
                    self.log(f"fleet: {self}: its maintenance is no longer announced after "
                             f"{clock(waited)}")
                return
            if announced is None:
                self.log(f"fleet: {self} announces maintenance ({reason}): it takes no job until "
                         f"that is over (hydra.launcher.maintenance_wait_s="
                         f"{self.cfg.maintenance_wait_s:g} at most)")
            announced = reason
            time.sleep(self.cfg.poll_s)
        if announced and needed():
            self.log(f"fleet: {self}: maintenance not over after {clock(waited)} (last seen: "
                     f"{announced}): going on")

    def health(self) -> str:
        return vm_health(self.state(), self.cfg.queued)

    def answer(self) -> str:
        """:meth:`state`, or NO_ANSWER (logged) when gcloud fails: one failed call among the
        hundreds a long wait makes must not end a job or a recreation."""
        try:
            return self.state()
        except LaunchError as e:
            self.log(f"fleet: {self}: no answer from gcloud: {e}")
            return NO_ANSWER

    def check(self) -> None:
        """``vm_check`` for launch_job: raises VmLost when the VM is not READY. A gcloud that
        cannot answer gives no verdict: the job is then polled over ssh as usual."""
        state = self.answer()
        if state != NO_ANSWER and vm_health(state, self.cfg.queued) != UP:
            raise VmLost(self.name, state)

    def addresses(self) -> set[str]:
        """Every address of the node's workers (a recreated VM may get the old ones back)."""
        try:
            node = self.gcloud.find(self.name, self.cfg.zone, self.cfg.project)
        except LaunchError:
            return set()
        return {a for e in (node or {}).get("networkEndpoints", [])
                for a in (e.get("ipAddress"), e.get("accessConfig", {}).get("externalIp")) if a}

    # One loop over the VM's state, because every step (delete, create, wait) can end in any
    # state and the deadline and backoff span them all. Long: for that reason.
    def restore(self, lost_so_far=lambda: 0.0) -> None:
        """Bring the VM back to READY: delete it when it is down, create it again, retry with
        backoff while the zone has no capacity, wait while it comes up; all within
        ``ready_timeout_s`` (``maintenance_wait_s`` while the node is under maintenance, if
        longer), asking gcloud again while it fails to answer. A create refused by quota raises
        QuotaExceeded at once. After a create, forgets the old VM's host keys and connections
        and waits for the new one's login."""
        cfg = self.cfg
        t0, backoff, created = time.monotonic(), cfg.capacity_backoff_s, False
        ssh = Ssh(cfg, self.runner, self.log)
        key = ssh.authorized_key()  # before anything is deleted: an unreadable key stops here
        old = self.addresses()
        was_down, unanswered = False, ""
        while True:
            state = self.answer()
            health = PENDING if state == NO_ANSWER else vm_health(state, cfg.queued)  # asked again
            if health == UP:
                break
            was_down = was_down or state != NO_ANSWER
            waited = time.monotonic() - t0
            # a node under maintenance comes back by itself, after hours maybe
            limit = (("maintenance_wait_s", cfg.maintenance_wait_s)
                     if state == MAINTENANCE and cfg.maintenance_wait_s > cfg.ready_timeout_s
                     else ("ready_timeout_s", cfg.ready_timeout_s))
            if waited > limit[1]:
                if created:  # a VM nobody uses would run up its cost unattended
                    self._delete()
                raise LaunchError(f"{self} is still {state} after {clock(waited)} "
                                  f"(hydra.launcher.{limit[0]}={limit[1]:g}{unanswered})")
            if health == PENDING or state in ("DELETING", "SUSPENDING"):  # on its way up, or out
                time.sleep(cfg.poll_s)
                continue
            try:
                if state != NOT_FOUND:
                    self.log(f"fleet: {self} is {state}: deleting it")
                    self._delete()
                    if created:  # it failed on its way up: the zone has no capacity for it
                        backoff = self._wait_for_capacity(state, backoff, lost_so_far)
                    continue
                self.log(f"fleet: {self}: creating a {self.hardware.accelerator_type} "
                         f"({self.hardware.runtime_version}{', spot' if cfg.spot else ''})")
                created = True  # (asked for: a create failed with no verdict may have made it)
                self.gcloud.create(self.name, cfg.zone, self.hardware, cfg.project, cfg.spot,
                                   cfg.queued, key)
            except NoCapacity as e:
                backoff = self._wait_for_capacity(str(e), backoff, lost_so_far)
            except NoVerdict as e:  # the next turn sees what the call did, if anything
                self.log(f"fleet: {self}: no answer from gcloud: {e}; asking again")
                unanswered = f"; gcloud's last failure: {e}"
                time.sleep(cfg.poll_s)
        self.deletion_mark.unlink(missing_ok=True)  # READY: the name is a VM again
        if not created:  # the same VM, waited for or never down (a notice's stop): same keys
            if was_down:
                self.log(f"fleet: {self} is READY again after {clock(time.monotonic() - t0)}; "
                         f"{clock(lost_so_far())} lost so far")
            return
        for host in sorted(old | self.addresses()):
            ssh.forget(host)
        self._wait_for_login(ssh)
        self.log(f"fleet: {self} is READY again, {clock(time.monotonic() - t0)} after the "
                 f"recreation began; {clock(lost_so_far())} lost so far")

    def _wait_for_login(self, ssh: Ssh) -> None:
        """A new VM says READY before its guest agent has made the ``ssh-keys`` metadata the
        user's keys, maybe before sshd answers: while its workers refuse the login or do not
        answer, wait (``login_grace_s`` at most). Any other outcome is the launch's to report."""
        if self.cfg.login_grace_s <= 0:
            return
        deadline = time.monotonic() + self.cfg.login_grace_s
        try:
            node = self.gcloud.find(self.name, self.cfg.zone, self.cfg.project)  # the node itself
        except LaunchError as e:  # the launch describes it again (and asks again) to reach it
            self.log(f"fleet: {self}: no answer from gcloud, no wait for its login: {e}")
            return
        if node is None:  # gone again already: the launch says so
            return
        for host in [t.host for t in node_targets(node, self.cfg.address, self.hardware)]:
            while ssh.try_login(host) in ("refused", "unreachable") and time.monotonic() < deadline:
                time.sleep(LOGIN_POLL_S)

    def _wait_for_capacity(self, why: str, backoff: float, lost_so_far) -> float:
        self.log(f"fleet: {self}: no capacity ({why}); retrying in {backoff:g} s, "
                 f"{clock(lost_so_far())} lost so far")
        time.sleep(backoff)
        return min(backoff * 2, self.cfg.capacity_backoff_s * 16)
