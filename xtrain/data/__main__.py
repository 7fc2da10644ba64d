"""``python -m xtrain.data build SOURCES... --out DIR``: build a C++ corpus and tokenizer."""

from __future__ import annotations

import argparse
import json

from xtrain.config import DataConfig
from xtrain.data.corpus import CLI_NAMES, BuildSpec, ensure_built
from xtrain.errors import DataError, InputError, refuse
from xtrain.limits import out_of_range


def check_arguments(args) -> None:
    """The ranges a training's build is held to (xtrain/config/ DataConfig), and a held-out share
    that leaves files on both sides."""
    checked = {"vocab_size": args.vocab_size, "chunk_tokens": args.chunk_tokens}
    problems = []
    for problem in out_of_range(checked, DataConfig):  # "vocab_size=10: must be ..."
        field, rest = problem.split("=", 1)
        problems.append(f"--{field.replace('_', '-')} {rest}")
    if not 0 < args.val_fraction < 1:
        problems.append(f"--val-fraction {args.val_fraction:g}: must be > 0 and < 1 (the share of "
                        "files held out for validation)")
    if problems:
        raise DataError("; ".join(problems))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m xtrain.data")
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="C/C++ source trees -> parquet shards + BPE tokenizer")
    b.add_argument("sources", nargs="+", help="directories or fsspec URLs (gs://...) of C/C++ code")
    b.add_argument("--out", required=True, help="output directory or fsspec URL")
    b.add_argument("--vocab-size", type=int, default=65536)
    b.add_argument("--chunk-tokens", type=int, default=16384, help="token budget per chunk")
    b.add_argument("--val-fraction", type=float, default=0.05, help="fraction of files held out")
    args = parser.parse_args(argv)
    try:
        check_arguments(args)
    except InputError as ex:
        refuse(ex)
    spec = BuildSpec(sources=args.sources, out_dir=args.out, vocab_size=args.vocab_size,
                     chunk_tokens=args.chunk_tokens, val_fraction=args.val_fraction,
                     names=CLI_NAMES)
    try:
        manifest = ensure_built(spec)
    except InputError as ex:  # refused (e.g. an output directory holding other files): one line
        refuse(ex)
    print(json.dumps(manifest, indent=2))


if __name__ == "__main__":
    from xtrain.observe.console import mask_stderr  # (this entry point's own layer: tests/test_layering.py)

    mask_stderr()
    main()
