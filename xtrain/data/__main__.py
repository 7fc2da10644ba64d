"""``python -m xtrain.data build SOURCES... --out DIR``: build a C++ corpus and tokenizer."""

from __future__ import annotations

import argparse
import json

from xtrain.data.corpus import BuildSpec, ensure_built
from xtrain.errors import InputError, refuse


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
    spec = BuildSpec(sources=args.sources, out_dir=args.out, vocab_size=args.vocab_size,
                     chunk_tokens=args.chunk_tokens, val_fraction=args.val_fraction)
    try:
        manifest = ensure_built(spec)
    except InputError as ex:  # refused (e.g. an output directory holding other files): one line
        refuse(ex)
    print(json.dumps(manifest, indent=2))


if __name__ == "__main__":
    from xtrain.observe.console import mask_stderr  # (this entry point's own layer: tests/test_layering.py)

    mask_stderr()
    main()
