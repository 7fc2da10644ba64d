"""The console: xtrain's messages through Python logging (INFO on stdout, warnings on stderr),
each also written to ``<run dir>/console.log`` with a timestamp, secrets masked, and a progress
display fed by the run's records.

On a terminal the display is a rich progress bar (step, loss, tok/s, MFU, elapsed, ETA) under
the log lines; elsewhere (a pipe, a file, CI) plain lines only. Either way it changes only when
a record arrives, i.e. at the logging interval: nothing reads the device to draw it.
"""

from __future__ import annotations

import contextlib
import datetime
import io
import logging
import sys
import threading
import traceback
import warnings

from xtrain.errors import printed_masked, warn
from xtrain.observe.bundle import mask_secrets
from xtrain.observe.sinks import AppendFile, Sink

LOGGERS = ("xtrain", "lightning.pytorch", "py.warnings")  # what the console and console.log show
CONSOLE_FILE = "console.log"


class _Masked(logging.Formatter):
    """Lines with secrets masked (xtrain/observe/bundle.py mask_secrets): a message or an
    exception may quote a secret environment variable's value or a token."""

    def format(self, record):
        return mask_secrets(super().format(record))


class _Current(logging.StreamHandler):
    """Writes to whatever ``sys.stdout`` (or ``sys.stderr``) is at the time: rich's live display
    redirects both, so lines scroll above the progress bar instead of landing on it; nothing
    when the stream is closed (``>&-``). The stdout one takes INFO and below, the stderr one
    warnings and up."""

    def __init__(self, name: str):
        super().__init__()
        self.name_in_sys = name
        if name == "stdout":
            self.addFilter(lambda r: r.levelno < logging.WARNING)
        else:
            self.setLevel(logging.WARNING)

    @property
    def stream(self):
        return getattr(sys, self.name_in_sys)

    @stream.setter
    def stream(self, value):
        pass

    def emit(self, record):
        if self.stream is not None:
            super().emit(record)


class _FileHandler(logging.Handler):
    def __init__(self, file: AppendFile):
        super().__init__()
        self.file = file
        self.setFormatter(_Masked("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        self.failing = False

    def createLock(self):
        # no handler lock: the file has its own, and a library logging from inside this
        # handler's upload (xtrain/observe/sinks.py AppendFile.write) must not wait for it
        self.lock = None

    def emit(self, record):
        self.guarded(self.file.write, self.format(record) + "\n")

    def guarded(self, call, *args) -> None:
        """console.log never stops a run or changes its outcome: a failed write or upload (a full
        disk; a storage outage, after gcsfs's retries: a remote file keeps its lines for the next
        upload, AppendFile) is said in one line on stderr, once until one succeeds."""
        try:
            wrote = call(*args)
        except Exception as e:  # noqa: BLE001  (each filesystem raises its own types)
            if not self.failing:
                self.failing = True  # (before the warning, which reaches this handler too)
                warn(f"{self.file.path} could not be written ({type(e).__name__}: {e}); the run "
                     "goes on")
            return
        if wrote:  # (not a line held, or kept for the next upload: they tell nothing)
            self.failing = False


def _quiet_libraries(record) -> bool:
    """Libraries' warnings only: Lightning resets its logger to INFO when it is imported, and its
    INFO lines (accelerator probes, tips) are not xtrain's."""
    return record.levelno >= logging.WARNING or record.name.startswith("xtrain")


class ConsoleLog:
    """Logging for one run, as a context manager: handlers on :data:`LOGGERS` (propagation off,
    so nothing prints twice) and, in place of the root logger's own (Hydra's), on the root,
    where any other library's records arrive: masked, warnings in console.log only (a mode that
    keeps no console.log drops them), errors on stderr too. Put back on exit.
    An exception leaving the block is written to console.log with its traceback (the console
    itself shows what the CLI prints)."""

    def __init__(self, run_dir: str | None, level: int = logging.INFO):
        self.file = AppendFile(f"{run_dir.rstrip('/')}/{CONSOLE_FILE}") if run_dir else None
        consoles = [_Current("stdout"), _Current("stderr")]
        for console in consoles:
            console.setFormatter(_Masked())
        self._to_file = _FileHandler(self.file) if self.file else None
        files = [self._to_file] if self._to_file else []
        self.handlers = consoles + files
        # other libraries' records, on the root: their warnings (gcsfs falling back from a bucket
        # probe, google.auth's metadata-server probe: each request, without credentials) go to
        # console.log alone, so that the console, and a refusal's one line, stay xtrain's; their
        # errors show on stderr too
        library_errors = _Current("stderr")
        library_errors.setLevel(logging.ERROR)
        library_errors.setFormatter(_Masked())
        self.root_handlers = [library_errors] + files
        for handler in self.handlers + self.root_handlers:
            handler.addFilter(_quiet_libraries)
        self.level = level
        self._saved = {}

    def __enter__(self):
        logging.captureWarnings(True)
        # (a root with handlers also keeps Lightning, imported in the block, from giving its
        # logger one of its own)
        root = logging.getLogger()
        self._root_handlers, root.handlers = list(root.handlers), list(self.root_handlers)
        # TensorBoard's import warns that without TensorFlow it cannot write gs:// paths; xtrain
        # gives it a local directory (xtrain/observe/loggers.py)
        logging.getLogger("absl").setLevel(logging.ERROR)
        for name in LOGGERS:
            logger = logging.getLogger(name)
            self._saved[name] = (logger.level, logger.propagate, list(logger.handlers))
            logger.handlers = list(self.handlers)
            logger.propagate = False
            logger.setLevel(self.level)
        return self

    def __exit__(self, kind, error, tb):
        if error is not None and self.file is not None:
            stamp = datetime.datetime.now().isoformat(sep=" ", timespec="seconds")
            text = mask_secrets("".join(traceback.format_exception(kind, error, tb)))
            self._to_file.guarded(self.file.write, f"{stamp} ERROR {text}")
        for name, (level, propagate, handlers) in self._saved.items():
            logger = logging.getLogger(name)
            logger.handlers, logger.propagate = handlers, propagate
            logger.setLevel(level)
        logging.captureWarnings(False)
        logging.getLogger().handlers = self._root_handlers
        if self.file is not None:
            self._to_file.guarded(self.file.close)
        return False


# One report at a time: each swaps the process's sys.stderr, and two threads' reports overlapping
# would let one write past its mask and leave sys.stderr on the other's buffer.
_REPORTING = threading.RLock()


def masked_stderr(report):
    """Run ``report`` with what it writes on stderr masked (xtrain/observe/bundle.py mask_secrets):
    a crash's traceback, printed outside a run's console log by Hydra or by the interpreter, may
    quote a secret environment variable's value or a token."""
    text = io.StringIO()
    with _REPORTING:
        try:
            with contextlib.redirect_stderr(text):
                return report()
        finally:
            sys.stderr.write(mask_secrets(text.getvalue()))
            sys.stderr.flush()


def _masked_excepthook(kind, value, tb) -> None:
    masked_stderr(lambda: sys.__excepthook__(kind, value, tb))


def _masked_thread_excepthook(args) -> None:
    masked_stderr(lambda: threading.__excepthook__(args))


def _masked_showwarning(message, category, filename, lineno, file=None, line=None) -> None:
    file = sys.stderr if file is None else file
    if file is not None:  # (as Python's own: no stderr, no warning; a closed one, no warning)
        with contextlib.suppress(OSError):
            file.write(mask_secrets(warnings.formatwarning(message, category, filename, lineno, line)))


def mask_stderr() -> None:
    """Mask secrets out of what an entry point's process prints on stderr outside a run's console
    log: refusals and warnings (xtrain/errors.py), Python's warnings, and the traceback of an
    exception that ends the process or a thread (a library's: W&B's). Inside a run, ConsoleLog
    takes Python's warnings and restores this on exit."""
    printed_masked(mask_secrets)
    sys.excepthook = _masked_excepthook
    threading.excepthook = _masked_thread_excepthook
    warnings.showwarning = _masked_showwarning


def clock(seconds: float | None) -> str:
    if seconds is None:
        return "--:--"
    return str(datetime.timedelta(seconds=round(seconds)))


def train_line(r: dict, max_steps: int) -> str:
    mfu = f" | mfu {r['mfu']:.1%}" if "mfu" in r else ""
    return (f"step {r['step']:6d}/{max_steps} | loss {r['loss']:.4f} | lr {r['lr']:.2e} | "
            f"{r['tok_per_s']:,.0f} tok/s{mfu} | elapsed {clock(r.get('elapsed_s'))} | "
            f"eta {clock(r.get('eta_s'))}")


def record_line(r: dict, max_steps: int) -> str | None:
    """The console line for a record (None: the record is not shown)."""
    kind, step = r["kind"], r["step"]
    if kind == "train":
        return train_line(r, max_steps)
    if kind == "val":
        return f"step {step:6d} | val loss {r['val_loss']:.4f} | val bpb {r['val_bpb']:.4f}"
    if kind == "checkpoint":
        return f"step {step:6d} | checkpoint committed in {r['ckpt_s']:.2f} s"
    if kind == "stop":  # xtrain/train/run.py says it, with the fate of the stop's checkpoint
        return None
    if kind == "sample" and "skipped" in r:
        return f"step {step:6d} | sample skipped: {r['skipped']}"
    if kind == "sample":
        texts = "\n".join(f"--- {s['prompt']!r}\n{s['prompt']}{s['text']}" for s in r["samples"])
        return f"step {step:6d} | sample ({r['sample_tok_per_s']:,.0f} tok/s):\n{texts}"
    scores = " | ".join(f"{k} {v:.4g}" for k, v in r.items()
                        if k not in ("step", "kind", "time") and isinstance(v, (int, float)))
    return f"step {step:6d} | {kind} | {scores}"


class ProgressDisplay(Sink):
    """Log lines for records; on a terminal also a progress bar refreshed only when a train
    record arrives."""

    def __init__(self, max_steps: int, start_step: int = 0, tty: bool | None = None,
                 console=None, log: logging.Logger | None = None):
        """``console``: rich's Console to draw on (default: stdout's)."""
        self.max_steps = max_steps
        self.log = log or logging.getLogger("xtrain.progress")
        self.tty = bool(sys.stdout and sys.stdout.isatty()) if tty is None else tty
        self._progress = self._task = None
        if self.tty:
            self._start_bar(start_step, console)

    def _start_bar(self, start_step: int, console) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, Progress, TextColumn

        # a narrow bar, the step first: on an 80-column terminal the line's end is what is cut;
        # log lines above it keep their length (soft wrap: the terminal wraps them, rich does not)
        self._progress = Progress(
            BarColumn(bar_width=16),
            TextColumn("{task.completed}/{task.total} | loss {task.fields[loss]} | {task.fields[tok_s]} tok/s"
                       " | mfu {task.fields[mfu]} | elapsed {task.fields[elapsed]} | eta {task.fields[eta]}"),
            console=console or Console(soft_wrap=True), auto_refresh=False, redirect_stdout=True,
            redirect_stderr=True)
        self._task = self._progress.add_task("train", total=self.max_steps, completed=start_step,
                                             loss="-", tok_s="-", mfu="-", elapsed="-", eta="-")
        self._progress.start()

    def write(self, record: dict) -> None:
        line = record_line(record, self.max_steps)
        if line:
            self.log.info(line)
        if self._progress is not None and record["kind"] == "train":
            mfu = f"{record['mfu']:.1%}" if "mfu" in record else "-"
            self._progress.update(self._task, completed=record["step"], loss=f"{record['loss']:.4f}",
                                  tok_s=f"{record['tok_per_s']:,.0f}", mfu=mfu,
                                  elapsed=clock(record.get("elapsed_s")), eta=clock(record.get("eta_s")))
            self._progress.refresh()

    def close(self, status: str = "success") -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
