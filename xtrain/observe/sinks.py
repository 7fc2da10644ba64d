"""Where metric records go, behind one interface: a record is a flat dict with a ``step``.

Every sink is written from rank 0 only (the metrics callback decides), from the training thread
and from the checkpoint upload thread, so ``write`` must be thread-safe.
"""

from __future__ import annotations

import json
import threading

from xtrain.paths import is_local, url_to_fs


class Sink:
    def write(self, record: dict) -> None:
        raise NotImplementedError

    def close(self) -> None:
        pass


class JsonlSink(Sink):
    """``metrics.jsonl``: one JSON object per record, through fsspec. Object stores cannot append,
    so a remote file is rewritten whole on every write (records are small and logged every
    ``log_every`` steps); a local file is appended to."""

    def __init__(self, path: str):
        self.path = path
        self._lock = threading.Lock()
        self._fs, self._root = url_to_fs(path)
        self._fs.makedirs(self._root.rsplit("/", 1)[0], exist_ok=True)
        self._lines: list[str] | None = None
        if not is_local(path):  # continue an existing file (a resumed run)
            self._lines = (self._fs.cat_file(self._root).decode().splitlines(keepends=True)
                           if self._fs.exists(self._root) else [])

    def write(self, record: dict) -> None:
        line = json.dumps(record) + "\n"
        with self._lock:
            if self._lines is None:
                with open(self._root, "a") as f:
                    f.write(line)
            else:
                self._lines.append(line)
                self._fs.pipe_file(self._root, "".join(self._lines).encode())


class ConsoleSink(Sink):
    """One line per training record and per evaluation."""

    def __init__(self, max_steps: int):
        self.max_steps = max_steps

    def write(self, record: dict) -> None:
        step = record["step"]
        if "loss" in record:
            mfu = f" | mfu {record['mfu']:.1%}" if "mfu" in record else ""
            print(f"step {step:6d}/{self.max_steps} | loss {record['loss']:.4f} | lr {record['lr']:.2e} | "
                  f"{record['tok_per_s']:,.0f} tok/s" + mfu, flush=True)
        elif "val_loss" in record:
            print(f"step {step:6d} | val loss {record['val_loss']:.4f} | val bpb {record['val_bpb']:.4f}",
                  flush=True)


class WandbSink(Sink):
    """A W&B run. The key comes from WANDB_API_KEY in the environment; configs never hold it, so
    no secret reaches the uploaded config."""

    def __init__(self, project: str, entity: str | None, name: str, run_dir: str, config: dict):
        import wandb

        safe_id = "".join(c if c.isalnum() or c in "-_." else "_" for c in name)[:128]
        self.run = wandb.init(project=project, entity=entity, name=name, id=safe_id, resume="allow",
                              dir=run_dir, config=config)

    def write(self, record: dict) -> None:
        self.run.log({k: v for k, v in record.items() if k != "step"}, step=record["step"])

    def close(self) -> None:
        self.run.finish()
