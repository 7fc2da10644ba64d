"""One training at a time in a checkpoint directory. Two trainings writing one ``checkpoint.dir``
(the same run launched on two VMs, or a sweep's jobs given one dir) would replace each other's
checkpoints step by step, and each one's retention would delete the other's. The run dir's flock
(xtrain/train/run_lock.py) cannot see them: they run in other run dirs, on other hosts, over a
bucket.

So a training's first process holds a lease, ``<dir>/.lease.json``: who holds it (run, host,
pid) and when it was last renewed, every quarter of ``checkpoint.lease_s``; it is removed when
the training ends. A start that finds a lease takes it over when its holder is gone: a process
of this host and PID namespace (a container sharing the VM's hostname has its own) that no
longer runs, or a lease not renewed for ``lease_s`` (by the holder's clock;
VMs keep theirs by NTP, and a start waits no longer than ``lease_s`` by its own). Otherwise it
watches the lease: renewed, its holder lives and the start is refused.

Object stores offer no compare-and-swap through fsspec, so the lease is taken by writing it and
reading it back: of two starts at the same moment, the later writer holds it and the other is
refused; one that read it back before the other wrote learns at its next renewal, and its next
save (:meth:`Lease.check`, before each save and before its commit) ends the training rather than
mixing its checkpoints with the other's (xtrain/checkpoint/async_io.py).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid

from xtrain.errors import CheckpointError, ConfigError, warn
from xtrain.paths import is_local, url_to_fs

log = logging.getLogger(__name__)

LEASE_FILE = ".lease.json"
SETTLE_S = 1.0  # between writing a lease to a bucket and reading it back (another start's write)


class CheckpointDirInUse(ConfigError):
    """Refused: another training holds the checkpoint directory's lease."""


class LeaseLost(CheckpointError):
    """A training's lease was taken over (it was not renewed in time): it saves no more there."""


def holder_text(held: dict) -> str:
    return f"run {held.get('run')} on {held.get('host')} (pid {held.get('pid')})"


def process_space() -> str | None:
    """This boot of this machine and its PID namespace: where a holder's pid names the same
    process (None: unknown here)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f"{f.read().strip()}/{os.stat('/proc/self/ns/pid').st_ino}"
    except OSError:
        return None


def gone(held: dict) -> str | None:
    """Why the lease ``held`` no longer holds (None: it may): its process ended here (this host,
    boot and PID namespace), or it expired."""
    space = process_space()
    here = held.get("host") == socket.gethostname() and space is not None and held.get("space") == space
    if here and not _running(held.get("pid")):
        return f"{holder_text(held)} no longer runs"
    age = time.time() - float(held.get("renewed", 0))
    if age > float(held.get("lease_s", 0)):
        return f"{holder_text(held)} last renewed it {age:.0f} s ago, past its {held.get('lease_s')} s"
    return None


def _well_formed(held) -> bool:
    """Whether ``held`` has the fields :func:`gone` and the holder checks read, of their types."""
    def number(value) -> bool:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return (isinstance(held, dict) and isinstance(held.get("holder"), str)
            and number(held.get("renewed")) and number(held.get("lease_s")))


def _running(pid) -> bool:
    try:
        os.kill(int(pid), 0)
    except (ProcessLookupError, TypeError, ValueError):
        return False
    except PermissionError:  # another user's process
        return True
    return True


class Lease:
    """The lease on ``directory`` for the run ``run_name``; :meth:`acquire` takes it (or refuses),
    :meth:`release` gives it back."""

    def __init__(self, directory: str, run_name: str, lease_s: float):
        self.directory, self.lease_s = directory, float(lease_s)
        self.fs, root = url_to_fs(directory)
        self.root, self.path = root.rstrip("/"), f"{root.rstrip('/')}/{LEASE_FILE}"
        self.mine = {"holder": uuid.uuid4().hex, "run": run_name, "host": socket.gethostname(),
                     "pid": os.getpid(), "space": process_space()}
        self.lost: dict | None = None  # the lease that replaced this one, once seen
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None

    def read(self) -> dict | None:
        self.fs.invalidate_cache()
        try:
            held = json.loads(self.fs.cat_file(self.path))
        except FileNotFoundError:
            return None
        except (ValueError, UnicodeDecodeError):
            held = None
        if not _well_formed(held):  # written by hand, or not by xtrain: nobody's
            warn(f"{self.directory}/{LEASE_FILE} is not a lease xtrain wrote: replaced")
            return None
        return held

    def _write(self) -> None:
        record = json.dumps({**self.mine, "renewed": time.time(), "lease_s": self.lease_s}).encode()
        if is_local(self.directory):  # written aside and renamed: never read half-written
            aside = f"{self.path}.{self.mine['holder']}"
            self.fs.pipe_file(aside, record)
            self.fs.mv(aside, self.path)
        else:  # an object is replaced whole
            self.fs.pipe_file(self.path, record)

    def acquire(self) -> Lease:
        self.fs.makedirs(self.root, exist_ok=True)
        held = self._wait_for_holder(self.read())
        if held is not None:
            why = gone(held) or f"{holder_text(held)} did not renew it while this start watched"
            warn(f"checkpoint.dir {self.directory}: taking over its lease ({why})")
        try:
            self._write()
            if not is_local(self.directory):
                time.sleep(SETTLE_S)
            held = self.read()
        except BaseException:  # (a storage error, Ctrl-C): not left behind to expire
            self._remove_if_mine()
            raise
        if (held or {}).get("holder") != self.mine["holder"]:
            raise CheckpointDirInUse(self._in_use(held or {}, "took it at the same moment"))
        self._renewer = threading.Thread(target=self._renew, daemon=True, name="xtrain-lease")
        self._renewer.start()
        return self

    def _wait_for_holder(self, held: dict | None) -> dict | None:
        """Watch a held lease until its holder is gone (returns it) or renews it (refused)."""
        if held is None or gone(held):
            return held
        patience = float(held.get("lease_s", self.lease_s))
        log.info("checkpoint.dir %s is held by %s: watching its lease for up to %.0f s",
                 self.directory, holder_text(held), patience)
        deadline = time.monotonic() + patience
        while time.monotonic() < deadline:
            time.sleep(min(2.0, patience / 8))
            now = self.read()
            if now is None or gone(now):
                return now
            if now != held:  # renewed (or taken by another start): someone lives
                raise CheckpointDirInUse(self._in_use(now, "renewed it just now"))
        return held  # not renewed for its whole term, whatever the clocks say

    def _in_use(self, held: dict, what: str) -> str:
        return (f"checkpoint.dir {self.directory} is in use: {holder_text(held)} {what}. Two "
                "trainings in one checkpoint dir would replace and delete each other's "
                "checkpoints: wait for that one or stop it, or give this run its own "
                f"checkpoint.dir (a training that died frees it within {self.lease_s:.0f} s, "
                "checkpoint.lease_s)")

    def _renew(self) -> None:
        failing = False
        while not self._stop.wait(self.lease_s / 4):
            try:
                held = self.read()
                if held is not None and held.get("holder") != self.mine["holder"]:
                    self.lost = held
                    warn(f"checkpoint.dir {self.directory}: {holder_text(held)} took over this "
                         "training's lease (not renewed in time): it saves no more checkpoints "
                         "there and ends at its next save")
                    return
                if not self._stop.is_set():  # (released meanwhile: not written back)
                    self._write()
                failing = False
            except Exception as e:  # noqa: BLE001  (storage errors come in many types)
                if not failing:  # once per run of failures
                    warn(f"could not renew the lease on checkpoint.dir {self.directory} "
                         f"({type(e).__name__}: {e}); trying again")
                failing = True

    def check(self) -> None:
        """Before a save: raise LeaseLost when another training holds the lease now."""
        held = self.read() if self.lost is None else self.lost
        if held is not None and held.get("holder") != self.mine["holder"]:
            self.lost = held
            raise LeaseLost(f"checkpoint.dir {self.directory} is now held by {holder_text(held)} "
                            "(this training's lease was not renewed in time): this training saves "
                            "no more there and ends at its next save")

    def release(self) -> None:
        self._stop.set()
        if self._renewer is not None:  # (a renewal stuck on storage does not hold up the exit)
            self._renewer.join(timeout=self.lease_s / 4)
        self._remove_if_mine()

    def _remove_if_mine(self) -> None:
        try:
            if (self.read() or {}).get("holder") == self.mine["holder"]:
                self.fs.rm(self.path)
        except Exception as e:  # noqa: BLE001
            warn(f"could not remove the lease {self.directory}/{LEASE_FILE} ({type(e).__name__}: "
                 f"{e}); the next start there takes it over once expired")
