"""The processes of a run, one per host, and what they do together outside the training step:
a barrier, a broadcast from process 0, a vote (the largest value: any-of for flags) that does
not stall a step, and naming a process that vanished.

Both engines use it: the CPU engine joins its processes over gloo itself (:func:`join_gloo`);
the XLA engine uses the gloo group torch_xla creates through ``xla://`` (xtrain/xla/runtime.py).
A one-process run is ``Processes()``: every method is then free.
"""

from __future__ import annotations

import contextlib
import json
import secrets
import threading
import time
from datetime import timedelta


class Processes:
    """``rank``/``world``: this process's index and the process count; process 0 alone writes
    metrics, logs, samples and checkpoint metadata. ``group``: the gloo group of the training
    thread's collectives. ``checkpoint_group``: a second gloo group, used only by the checkpoint
    upload thread (collectives of two threads on one group could be issued in different orders
    on different processes and deadlock). ``heartbeat``: see :class:`Heartbeat` (None: unknown)."""

    def __init__(self, rank: int = 0, world: int = 1, group=None, checkpoint_group=None,
                 heartbeat: Heartbeat | None = None):
        self.rank, self.world = rank, world
        self.group, self.checkpoint_group, self.heartbeat = group, checkpoint_group, heartbeat

    @property
    def primary(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.group is not None:
            import torch.distributed as dist

            dist.barrier(group=self.group)

    def broadcast(self, obj, src: int = 0):
        """Process ``src``'s ``obj`` on every process (any picklable value)."""
        if self.group is None:
            return obj
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=src, group=self.group)
        return box[0]

    def vote(self, value: int):
        """Start combining ``value`` (a flag, or a small non-negative int) with every process's:
        the largest, so a flag is set if any process set it; without waiting. Returns a function
        that waits for the result (an int, the same on every process)."""
        if self.group is None:
            return lambda: int(value)
        import torch
        import torch.distributed as dist

        votes = torch.tensor([int(value)])
        work = dist.all_reduce(votes, op=dist.ReduceOp.MAX, group=self.group, async_op=True)

        def result() -> int:
            work.wait()
            return int(votes.item())

        return result

    def primary_first(self, what: str, work, then=None):
        """``work()`` on process 0 while the others wait, for as long as it takes while process
        0 lives (a barrier would give up after trainer.collective_timeout_s, which a first corpus
        build can outlast); its failure ends the others too, saying so (a refusal as the same
        refusal). With ``then``, ``then()`` runs next on the other processes while process 0
        waits for them likewise (hosts that do not share process 0's disk build their own copy,
        which takes as long). Returns ``work()``'s result on process 0, ``then()``'s (or None)
        on the others."""
        if self.heartbeat is None:  # no store to wait on (torch_xla's dummy store): barriers
            result = work() if self.primary else None
            self.barrier()
            if then is not None:
                result = result if self.primary else then()
                self.barrier()
            return result
        # keys of this call's own: a sweep's next job, or a worker restarted under torchrun's
        # agent (whose store outlives it), must not read an earlier call's outcome
        call = self.broadcast(secrets.token_hex(4) if self.primary else None)
        store = self.heartbeat.store(f"xtrain-primary-first/{call}")
        if self.primary:
            result = self._lead(store, "outcome", work)
            if then is not None:
                for rank in range(1, self.world):
                    self._follow(store, f"outcome{rank}", what, rank)
            return result
        self._follow(store, "outcome", what, 0)
        return None if then is None else self._lead(store, f"outcome{self.rank}", then)

    def _lead(self, store, key: str, work):
        """``work()``, its outcome then set at ``key`` for the processes that follow it."""
        try:
            result = work()
        except Exception as e:
            from xtrain.observe.bundle import mask_secrets

            # its class as xtrain.errors names it (a refusal stays one), and its message
            kind = next((c.__name__ for c in type(e).__mro__ if c.__module__ == "xtrain.errors"),
                        type(e).__name__)
            store.set(key, json.dumps([kind, mask_secrets(str(e))[:2000]]))
            self._until_read(store, key)
            raise
        store.set(key, "")
        self._until_read(store, key)
        return result

    def _until_read(self, store, key: str) -> None:
        """Wait until the processes that follow ``key`` have read it. The store lives in process
        0 (or its host's launcher), which may end right after its work (its own error, or one
        every process raises next): a follower that finds the store gone before it read the
        outcome takes process 0 for lost. A few seconds at most: they look every beat."""
        deadline = time.monotonic() + 10 * Heartbeat.INTERVAL_S
        readers = self.world - 1 if key == "outcome" else 1
        with contextlib.suppress(Exception):  # (process 0 read it and ended, with its store)
            while store.add(f"{key}-read", 0) < readers and time.monotonic() < deadline:
                time.sleep(0.1)

    def _follow(self, store, key: str, what: str, leader: int) -> None:
        """Wait for the outcome at ``key`` of process ``leader``'s work, while every process
        lives; its failure raised here too."""
        from xtrain import errors

        while not store.check([key]):
            time.sleep(Heartbeat.INTERVAL_S)
            # (twice: a process whose heartbeat thread waited on a busy interpreter is not lost)
            if not store.check([key]) and (lost := self.vanished() and self.vanished()):
                raise errors.PeerLost(f"lost {lost} while it was busy with {what}; this is rank {self.rank}")
        outcome = store.get(key).decode()
        store.add(f"{key}-read", 1)
        if outcome:
            kind, message = json.loads(outcome)
            refusal = getattr(errors, kind, None)
            if isinstance(refusal, type) and issubclass(refusal, errors.InputError):
                raise refusal(f"rank {leader}: {message}")
            raise errors.PeerLost(f"rank {leader} failed in {what} ({kind}: "
                                  f"{message.splitlines()[0][:300]}); this is rank {self.rank}")

    def check_same(self, what: str, value: dict) -> None:
        """Refuse (ConfigError, on every process) a run whose processes hold different ``value``s
        (nested dicts; ``what`` names it): processes given different commands would train
        different models as one, or wait for each other's collectives until the timeout."""
        if self.group is None:
            return
        import torch.distributed as dist

        from xtrain.errors import ConfigError

        values = [None] * self.world
        dist.all_gather_object(values, value, group=self.group)
        others = [r for r, v in enumerate(values) if v != values[0]]
        if others:
            keys = differing_keys(values[0], values[others[0]])
            raise ConfigError(
                f"rank{'s' if len(others) > 1 else ''} {', '.join(map(str, others))} of {self.world} "
                f"{'have' if len(others) > 1 else 'has'} another {what} than rank 0 (rank {others[0]}: "
                f"{', '.join(keys[:5])}{', ...' if len(keys) > 5 else ''}): every process of a run "
                "needs the same command and files")

    def vanished(self) -> str | None:
        """Which process is gone, in words, or None when all are alive (or it cannot be told)."""
        return self.heartbeat.vanished() if self.heartbeat else None

    def say_failed(self, error: Exception) -> None:
        """This process's ``error``, in a line, for the others to name (secrets masked)."""
        if self.heartbeat:
            from xtrain.observe.bundle import mask_secrets

            lines = mask_secrets(str(error)).splitlines() or [""]
            self.heartbeat.say_failed(f"{type(error).__name__}: {lines[0][:300]}")

    def close(self) -> None:
        """Stop the heartbeat and leave the process groups (at the end of a run: a store call or
        a gloo group left to the interpreter's exit can abort the process)."""
        if self.heartbeat:
            self.heartbeat.stop()
        if self.group is not None:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
            self.group = self.checkpoint_group = None


def differing_keys(a: dict, b: dict, prefix: str = "") -> list[str]:
    """The dotted keys whose values differ between two nested dicts (either one lacking a key
    counts)."""
    keys = []
    for key in sorted(a.keys() | b.keys(), key=str):
        left, right = a.get(key), b.get(key)
        if isinstance(left, dict) and isinstance(right, dict):
            keys += differing_keys(left, right, f"{prefix}{key}.")
        elif left != right or (key in a) != (key in b):
            keys.append(f"{prefix}{key}")
    return keys


class Heartbeat:
    """Each process bumps its own counter in the rendezvous store every ``INTERVAL_S`` seconds from
    a daemon thread; a process whose counter stopped moving is gone.

    Why not gloo itself: its errors do not say which peer died ("Read error [127.0.0.1]:24741:
    Connection reset by peer"), and after a peer's death the group fails every call, torch's
    ``monitored_barrier`` included (checked on torch 2.9.1). The store is a separate server
    (rank 0's process, or torchrun's agent), reached through a client connection of our own.
    """

    INTERVAL_S = 1.0

    def __init__(self, address: str, port: int, rank: int, world: int):
        self.address, self.port, self.rank, self.world = address, port, rank, world
        self._stop = threading.Event()
        store = self.store()
        store.add(self._key(rank), 1)
        self._thread = threading.Thread(target=self._beat, args=(store,), daemon=True,
                                        name="xtrain-heartbeat")
        self._thread.start()

    def store(self, prefix: str = "xtrain-heartbeat", timeout_s: float = 30.0):
        """A client of the rendezvous store of our own, its keys under ``prefix``."""
        import torch.distributed as dist

        client = dist.TCPStore(self.address, self.port, is_master=False,
                               timeout=timedelta(seconds=timeout_s), wait_for_workers=False)
        return dist.PrefixStore(prefix, client)

    @staticmethod
    def _key(rank: int) -> str:
        return f"rank{rank}"

    def _beat(self, store) -> None:
        while not self._stop.wait(self.INTERVAL_S):
            try:
                store.add(self._key(self.rank), 1)
            except Exception:  # noqa: BLE001  (the store's host is gone: vanished() says so)
                return

    def vanished(self) -> str | None:
        """Reads every counter twice, three beats apart (a few seconds, once, on failure)."""
        try:
            store = self.store(timeout_s=5.0)
            before = [store.add(self._key(r), 0) for r in range(self.world)]
            time.sleep(3 * self.INTERVAL_S)
            after = [store.add(self._key(r), 0) for r in range(self.world)]
            gone = [r for r in range(self.world) if r != self.rank and after[r] == before[r]]
            said = [f"rank {r}: {store.get(f'error{r}').decode()}" for r in gone
                    if store.check([f"error{r}"])]
        except Exception as e:  # noqa: BLE001  (connection refused, reset, timeout...)
            return (f"rank 0 of {self.world} (or the launcher hosting the rendezvous store at "
                    f"{self.address}:{self.port}): the store is unreachable ({type(e).__name__})")
        if not gone:
            return None
        ranks = ", ".join(map(str, gone))
        return (f"rank{'s' if len(gone) > 1 else ''} {ranks} of {self.world}: no heartbeat for "
                f"{3 * self.INTERVAL_S:.0f} s" + (f" (its error, {'; '.join(said)})" if said else ""))

    def say_failed(self, text: str) -> None:
        """Leave this process's error where the others read it when they find it gone
        (:meth:`vanished`): the run's log is process 0's, a failing host's own log is not."""
        with contextlib.suppress(Exception):  # (the store's host may be gone too)
            self.store(timeout_s=5.0).set(f"error{self.rank}", text)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2 * self.INTERVAL_S)


def join_gloo(rank: int, world: int, timeout_s: float, store: str) -> Processes:
    """Join the run's processes over gloo (torch's env:// rendezvous: ``store`` is
    MASTER_ADDR:MASTER_PORT, where rank 0 or torchrun's agent hosts the store)."""
    import torch.distributed as dist

    from xtrain.errors import PeerLost

    try:
        waiting_for_signals(lambda: dist.init_process_group(
            "gloo", init_method="env://", rank=rank, world_size=world,
            timeout=timedelta(seconds=timeout_s)))
    except dist.DistError as e:  # the store's own words name no process
        missing = (f"not every process of {world} joined rank 0's store at {store}" if rank == 0
                   else f"rank 0's store at {store} did not let this rank {rank} join")
        raise PeerLost(f"{missing} within trainer.collective_timeout_s={timeout_s:g} s: a process "
                       "that was not started, or that ended at start (its log says why) "
                       f"({type(e).__name__}: {str(e).splitlines()[0][:200]})") from e
    return joined(rank, world, timeout_s)


def waiting_for_signals(call):
    """``call()`` in a thread while this one waits in short slices, its result returned or its
    error raised here. A rendezvous waits in C++ (up to its timeout, minutes) for processes that
    may never come; Python runs signal handlers only between its own instructions, so a SIGTERM
    there would take effect at the timeout. Waiting here, it raises at once."""
    outcome = {}

    def run():
        try:
            outcome["value"] = call()
        except BaseException as e:  # re-raised in the waiting thread
            outcome["error"] = e

    thread = threading.Thread(target=run, name="xtrain-rendezvous", daemon=True)
    thread.start()
    while thread.is_alive():
        thread.join(0.2)
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def joined(rank: int, world: int, timeout_s: float) -> Processes:
    """The run's processes once torch's default gloo group is up (either engine's rendezvous):
    a second group for checkpoint uploads, and the heartbeat through the rendezvous store."""
    import torch.distributed as dist

    checkpoint_group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
    address = store_address()
    heartbeat = Heartbeat(*address, rank, world) if address else None
    return Processes(rank, world, dist.group.WORLD, checkpoint_group, heartbeat)


def store_address() -> tuple[str, int] | None:
    """Host and port of the default group's rendezvous store (env:// and torch_xla's xla://
    both serve a TCPStore, under prefixes); None for a store without an address (torch_xla's
    dummy store, ``XLA_USE_DUMMY_STORE=1``)."""
    import torch.distributed as dist

    store = dist.distributed_c10d._get_default_store()  # no public accessor (torch 2.9)
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    return (store.host, store.port) if isinstance(store, dist.TCPStore) else None
