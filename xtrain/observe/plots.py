"""Charts of runs, as PNG files: the ones each run writes into its run dir at the end
(:func:`write_run_plots`), and the shared pieces ``python -m xtrain.report`` draws several runs
with (xtrain/report.py). matplotlib with its Agg backend (files only, no display).
"""

from __future__ import annotations

import io
import json
import logging

from xtrain.paths import url_to_fs, write_whole

log = logging.getLogger(__name__)
NOT_METRICS = ("step", "time", "kind")
# records of a run's interruptions, kept when a resumed run logs their steps again
KEPT_ON_RESUME = ("preemption", "stop")
# the run dir's plots: file name -> (title, [(record kind, metric, label)], y label)
RUN_PLOTS = {
    "loss.png": ("loss", [("train", "loss", "train"), ("val", "val_loss", "validation")],
                 "loss (nats/token)"),
    "val_bpb.png": ("validation bits per byte", [("val", "val_bpb", "validation")], "bits per byte"),
    "throughput.png": ("throughput", [("train", "tok_per_s", "tokens/s")], "tokens/s"),
}


def read_records(run_dir: str, filename: str = "metrics.jsonl") -> list[dict]:
    """A run's records as its last attempt logged them. A resumed run logs again from its
    checkpoint's step: a train record at or before a step already logged drops every earlier
    record from that step on (the interrupted attempt's, which training no longer follows),
    except ``preemption`` and ``stop`` records, the history of the interruptions."""
    path = f"{run_dir.rstrip('/')}/{filename}"
    fs, root = url_to_fs(path)
    records: list[dict] = []
    furthest = -1
    # (bytes that are not UTF-8 make their line no record: skipped, said, as a line cut short)
    for r in parse_records(fs.cat_file(root).decode(errors="replace"), path):
        if _kind(r) == "train":
            if r["step"] <= furthest:
                records = [x for x in records
                           if x["step"] < r["step"] or x.get("kind") in KEPT_ON_RESUME]
            furthest = r["step"]
        records.append(r)
    latest = {(_kind(r), r["step"]): r for r in records}
    return sorted(latest.values(), key=lambda r: r["step"])


def parse_records(text: str, source: str) -> list[dict]:
    """The records of a metrics.jsonl's text. A line that is not a record (one cut short when a VM
    stopped mid-write) is skipped with a warning naming ``source``."""
    records, torn = [], 0
    for line in text.splitlines():
        if not line.strip():
            continue
        try:
            r = json.loads(line)
            r["step"] = int(r["step"])
        except (ValueError, KeyError, TypeError):
            torn += 1
            continue
        records.append(r)
    if torn:
        log.warning("%s: skipped %d line(s) that are not JSON records", source, torn)
    return records


def _kind(record: dict) -> str:
    return record.get("kind", "train" if "loss" in record else "other")


def metric_names(records: list[dict]) -> set[str]:
    return {k for r in records for k, v in r.items()
            if k not in NOT_METRICS and isinstance(v, (int, float)) and not isinstance(v, bool)}


# The scores an evaluation record holds (xtrain/evals/harness.py's score()); its other numbers
# are timings and throughput, where higher is not better.
SCORE_PREFIXES = ("cpp_compile_rate", "cpp_pass_rate", "cpp_pass@")


def eval_metrics(records: list[dict]) -> list[str]:
    """Scores of evaluation records (kind ``eval``), e.g. ``cpp_pass_rate``."""
    names = metric_names([r for r in records if r.get("kind") == "eval"])
    return sorted(n for n in names if n.startswith(SCORE_PREFIXES))


def series(records: list[dict], metric: str, kind: str | None = None) -> tuple[list, list]:
    pts = [(r["step"], r[metric]) for r in records
           if metric in r and (kind is None or r.get("kind") == kind)]
    return [p[0] for p in pts], [p[1] for p in pts]


def png(title: str, ylabel: str, lines: list[tuple[str, list, list]]) -> bytes:
    """One chart (steps on x) with a line per (label, steps, values); PNG bytes."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    for label, xs, ys in lines:
        ax.plot(xs, ys, marker="o" if len(xs) < 30 else None, markersize=3, label=label)
    ax.set(title=title, xlabel="step", ylabel=ylabel)
    ax.grid(alpha=0.3)
    if len(lines) > 1:
        ax.legend(fontsize=8)
    fig.tight_layout()
    out = io.BytesIO()
    fig.savefig(out, format="png")
    plt.close(fig)
    return out.getvalue()


def write_run_plots(run_dir: str, records: list[dict] | None = None) -> list[str]:
    """The run's charts in ``<run dir>/plots/``: loss, validation bpb, throughput and, when the run
    has evaluation scores, eval.png. Charts without data are skipped. Returns the paths."""
    if records is None:
        fs, root = url_to_fs(f"{run_dir.rstrip('/')}/metrics.jsonl")
        if not fs.exists(root):
            return []  # stopped before its first record: nothing to draw
        records = read_records(run_dir)
    written = []
    charts = dict(RUN_PLOTS)
    scores = eval_metrics(records)
    if scores:
        charts["eval.png"] = ("evaluation scores", [("eval", m, m) for m in scores], "score")
    for name, (title, wanted, ylabel) in charts.items():
        lines = [(label, *series(records, metric, kind)) for kind, metric, label in wanted]
        lines = [line for line in lines if line[1]]
        if lines:
            path = f"{run_dir.rstrip('/')}/plots/{name}"
            write_whole(path, png(title, ylabel, lines))  # a failed write keeps the last chart
            written.append(path)
    return written
