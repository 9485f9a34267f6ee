"""`hintserve docs generate [--check]`: the generated reference pages and figures of docs/ and README.md."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def _generate(args: argparse.Namespace) -> int:
    from services.docs.generate import generate

    root = Path(args.root) if args.root else ROOT
    if not (root / "bench" / "results").is_dir():
        raise FileNotFoundError(f"no bench/results in {root}: pass the repository root with --root")
    stale = generate(root, args.build_parser, check=args.check)  # the whole command line's, set by services/cli.py
    for path in stale:
        print(f"{'stale' if args.check else 'wrote'}: {path}", file=sys.stderr if args.check else sys.stdout)
    if args.check and stale:
        print("run `hintserve docs generate` and commit the result", file=sys.stderr)
        return 1
    return 0


def register(subparsers: Any) -> None:
    docs = subparsers.add_parser("docs", help="the documentation's generated pages")
    sub = docs.add_subparsers(dest="docs_command", required=True)
    gen = sub.add_parser("generate", help="CLI, knob, HTTP API and benchmark references from the code and "
                         "bench/results/*.json, and every generated block in docs/ and README.md")
    gen.add_argument("--check", action="store_true", help="write nothing; exit 1 if a generated page is stale")
    # No path as a default: the CLI reference it generates must read the same in every checkout.
    gen.add_argument("--root", help="repository root (default: this checkout)")
    gen.set_defaults(func=_generate)
