"""One verdict on a save for every process: a save is collective, so a process that retries,
gives up or returns alone would wait at the next barrier for processes that moved on."""

from __future__ import annotations

import torch

from xtrain.checkpoint.lease import LeaseLost

# what a process found, the largest winning: a failure, the lease lost (never retried), the
# step already committed by an earlier attempt of the same save (xtrain/checkpoint/io.py write)
FAILED, LEASE_LOST, DONE = 1, 2, 3


def agree(error: Exception | None, process_group, done: bool = False) -> bool:
    """Raise on every process when any one failed, so all of them retry a save together, or,
    when the directory's lease was lost, all give it up; else whether any found the save
    ``done``."""
    found = DONE if done else 0 if error is None else LEASE_LOST if isinstance(error, LeaseLost) \
        else FAILED
    if process_group is not None:
        import torch.distributed as dist

        flag = torch.tensor([found])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=process_group)
        found = int(flag.item())
    if found == DONE:
        return True
    if found == LEASE_LOST and not isinstance(error, LeaseLost):
        raise LeaseLost("the first process found the checkpoint dir's lease taken over")
    if error is not None:
        raise error
    if found:
        raise RuntimeError("another process failed to commit this checkpoint")
    return False


def check_fence(fence, rank: int, process_group) -> None:
    """Before a save, on every process: raise LeaseLost when the first host's ``fence`` does
    (see xtrain/checkpoint/io.py write). A storage error reading the lease is left to the save,
    which reads it again."""
    error = None
    if rank == 0 and fence is not None:
        try:
            fence()
        except LeaseLost as e:
            error = e
        except Exception:  # noqa: BLE001,S110  (each filesystem raises its own types)
            pass
    agree(error, process_group)
