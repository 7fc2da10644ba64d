"""``python -m xtrain.report RUN_DIR... --out DIR [--metrics loss,val_bpb,...]``: several runs, or
whole sweep dirs, drawn together (one PNG per metric, a line per run) with a summary table
(``summary.md``, ``summary.csv``, also printed): steps, final loss, final validation bits per
byte, median tokens/s, and the best of each evaluation score (higher is better, as for pass
rates); each run labelled with what its command changed that the others' did not. A RUN_DIR
holding ``metrics.jsonl`` is one run; otherwise every subdirectory holding one is (a sweep dir,
e.g. ``multirun/<sweep>/``), else every such subdirectory of its subdirectories (``multirun/``).
Paths may be fsspec URLs (gs://...).
"""

from __future__ import annotations

import argparse
import csv
import io
import statistics
import sys
from collections import Counter

import yaml

from xtrain.config.hydra_record import RECORD, SWEEP_RECORD
from xtrain.errors import EXIT_REFUSED, InputError
from xtrain.observe.plots import eval_metrics, metric_names, png, read_records, series
from xtrain.paths import as_url, url_to_fs, write_whole

DEFAULT_METRICS = ("loss", "val_loss", "val_bpb", "tok_per_s", "mfu")
METRICS_FILE = "metrics.jsonl"


def storage(url: str, named: str):
    """fsspec's (filesystem, path) of ``url``; a protocol fsspec does not know, or whose package
    is not installed, refused in one line naming it (``named``)."""
    try:
        return url_to_fs(url)
    except (ValueError, ImportError) as e:
        raise InputError(f"{named}: cannot be opened ({type(e).__name__}: {e})") from None


def find_runs(paths: list[str]) -> tuple[dict[str, str], list[str]]:
    """name -> run dir, for run dirs, sweep dirs (their subdirectories that hold runs) and dirs of
    sweeps (``multirun/``); and the job dirs among them without records. Runs of one name (the
    same job in two sweeps, the same sweep in two places) are named with as many of their parent
    dirs as tell them apart, so each keeps its own line and row."""
    found, unrecorded = [], []
    for path in paths:
        fs, root = storage(path, path)
        root = root.rstrip("/")
        if fs.exists(f"{root}/{METRICS_FILE}"):
            found.append(as_url(fs, root))  # as fsspec resolves it: ".", given twice, ... named alike
            continue
        runs, jobs = runs_below(fs, root, sweeps=True)
        if not runs:
            raise InputError(f"{path}: no {METRICS_FILE} in it, in its subdirectories or theirs")
        found += [as_url(fs, d) for d in runs]
        unrecorded += [as_url(fs, d) for d in jobs]
    found = list(dict.fromkeys(found))  # a run given twice is one run
    return {unique_tail(d, found): d for d in found}, list(dict.fromkeys(unrecorded))


def runs_below(fs, root: str, sweeps: bool, in_sweep: bool = False) -> tuple[list[str], list[str]]:
    """The run dirs among ``root``'s subdirectories (with ``sweeps``, also among theirs: a dir of
    sweeps; in a sweep's dir, one with its record, at any depth: ``hydra.sweep.subdir`` may nest
    them), and the job dirs there without records (a Hydra record or a console.log, but no
    metrics.jsonl: a job still starting, or one that ended before its first step)."""
    runs, jobs = [], []
    for d in subdirectories(fs, root):
        names = {e.rstrip("/").rsplit("/", 1)[-1] for e in fs.ls(d, detail=False)}
        if METRICS_FILE in names:
            runs.append(d)
        elif "console.log" in names or any(n.startswith(RECORD) for n in names):
            jobs.append(d)
        elif sweeps or in_sweep or SWEEP_RECORD in names:
            below = runs_below(fs, d, sweeps=False, in_sweep=in_sweep or SWEEP_RECORD in names)
            runs, jobs = runs + below[0], jobs + below[1]
    return runs, jobs


def subdirectories(fs, root: str) -> list[str]:
    """The directories in ``root``, hidden ones left out (an object store may list ``root``)."""
    if not fs.isdir(root):
        return []
    found = [e["name"].rstrip("/") for e in fs.ls(root, detail=True) if e["type"] == "directory"]
    return sorted(d for d in found if d != root and not d.rsplit("/", 1)[-1].startswith("."))


def unique_tail(path: str, paths: list[str]) -> str:
    """The shortest tail of ``path`` (its last dir names) that no other of ``paths`` ends with."""
    parts = path.split("/")
    for depth in range(1, len(parts)):
        tail = "/".join(parts[-depth:])
        if sum(p == tail or p.endswith("/" + tail) for p in paths) == 1:
            return tail
    return path


def summary_row(name: str, differs: str | None, records: list[dict], scores: list[str]) -> dict:
    train = [r for r in records if r.get("kind", "train") == "train" and "loss" in r]
    val = [r for r in records if "val_bpb" in r]
    rates = [r["tok_per_s"] for r in train[1:] or train if "tok_per_s" in r]  # step 1 compiles
    row = {"run": name, "differs in": "(none)" if differs == "" else differs or "",
           "steps": train[-1]["step"] if train else 0,
           "final loss": train[-1]["loss"] if train else None,
           "final val bpb": val[-1]["val_bpb"] if val else None,
           "tok/s (median)": round(statistics.median(rates), 1) if rates else None}
    for score in scores:
        _, values = series(records, score, "eval")
        row[f"best {score}"] = max(values) if values else None
    return row


def cell(v) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.4f}"
    return str(v)


def table_markdown(rows: list[dict]) -> str:
    cols = list(rows[0])
    lines = ["| " + " | ".join(cols) + " |", "|" + " --- |" * len(cols)]
    lines += ["| " + " | ".join(cell(r[c]).replace("|", "\\|") for c in cols) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def choose_metrics(asked: str | None, known: set[str], scores: list[str]) -> list[str]:
    if asked is None:
        return [m for m in DEFAULT_METRICS if m in known] + scores
    wanted = [m.strip() for m in asked.split(",") if m.strip()]
    unknown = [m for m in wanted if m not in known]
    if unknown:
        raise InputError(f"unknown metric {', '.join(map(repr, unknown))}: the runs have "
                         f"{', '.join(sorted(known))}")
    return wanted


def run_overrides(run_dir: str) -> list[str] | None:
    """The overrides of the run's last accepted command (its Hydra record), Hydra's own left out;
    None without a readable record (labels are no reason to fail a report)."""
    fs, root = url_to_fs(run_dir)
    try:
        given = yaml.safe_load(fs.cat_file(f"{root.rstrip('/')}/{RECORD}/overrides.yaml"))
    except (OSError, yaml.YAMLError):
        return None
    if not isinstance(given, list):
        return None
    return [str(o) for o in given if not str(o).lstrip("+~").startswith(("hydra.", "hydra/"))]


def differences(runs: dict[str, str]) -> dict[str, str | None]:
    """name -> the overrides of its command that not every run's command has (a sweep's swept
    values; "" for a run with none of its own), read from the records, since a run's name may be
    cut and hashed and its values may hold a ``-``. None without a record, or fewer than two."""
    given = {name: run_overrides(d) for name, d in runs.items()}
    recorded = [set(o) for o in given.values() if o is not None]
    if len(recorded) < 2:
        return dict.fromkeys(runs)
    shared = set.intersection(*recorded)
    return {name: None if o is None else " ".join(x for x in o if x not in shared)
            for name, o in given.items()}


def plot_labels(differ: dict[str, str | None]) -> dict[str, str]:
    """A run's line is labelled with its differences, or its name when it has none or shares
    them with another run."""
    alike = Counter(differ.values())
    return {name: d if d and alike[d] == 1 else name for name, d in differ.items()}


def make_out_dir(out: str) -> None:
    """``--out``, made a directory before anything is drawn: a file there, or a place that cannot
    be written, is refused in one line."""
    fs, root = storage(out, f"--out {out}")
    try:
        fs.makedirs(root, exist_ok=True)
    except OSError as e:
        raise InputError(f"--out {out}: cannot be made a directory ({type(e).__name__}: "
                         f"{e.strerror or e})") from None


def report(paths: list[str], out: str, metrics: str | None = None) -> list[dict]:
    dirs, unrecorded = find_runs(paths)
    for d in unrecorded:
        print(f"xtrain.report: warning: {d}: no {METRICS_FILE} (yet: a job still starting, or "
              "one that ended before its first step): left out", file=sys.stderr)
    runs = {name: read_records(d) for name, d in dirs.items()}
    known = set().union(*(metric_names(r) for r in runs.values()))
    scores = sorted(set().union(*(eval_metrics(r) for r in runs.values())))
    differ = differences(dirs)
    labels = plot_labels(differ)
    chosen = choose_metrics(metrics, known, scores)
    make_out_dir(out)
    for metric in chosen:
        lines = [(labels[name], *series(records, metric)) for name, records in runs.items()]
        write_whole(f"{out.rstrip('/')}/{metric}.png",
                    png(metric, metric, [line for line in lines if line[1]]))
    rows = [summary_row(name, differ[name], records, scores) for name, records in runs.items()]
    write_whole(f"{out.rstrip('/')}/summary.md", table_markdown(rows).encode())
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=list(rows[0]))
    writer.writeheader()
    writer.writerows(rows)
    write_whole(f"{out.rstrip('/')}/summary.csv", buffer.getvalue().encode())
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m xtrain.report", description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR",
                        help="run dirs, sweep dirs or dirs of sweeps (multirun/)")
    parser.add_argument("--out", required=True, help="directory for the PNGs and summary tables")
    parser.add_argument("--metrics", help="comma-separated metrics to draw (default: loss, "
                        "val_loss, val_bpb, tok_per_s, mfu and every evaluation score)")
    args = parser.parse_args(argv)
    try:
        rows = report(args.run_dirs, args.out, args.metrics)
    except InputError as e:
        print(f"xtrain.report: {e}", file=sys.stderr)
        sys.exit(EXIT_REFUSED)
    print(table_markdown(rows), end="")
    print(f"plots and summary in {args.out}")


if __name__ == "__main__":
    main()
