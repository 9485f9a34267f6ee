"""The `hintserve` command line: one subcommand per service or tool."""

from __future__ import annotations

import argparse
import importlib
import sys

# Each module exposes `register(subparsers)` adding its subcommand(s); each parser sets `func`.
_COMMAND_MODULES = (
    "services.engine.cli",
    "services.engine.demo_model.cli",
    "services.gateway.cli",
    "services.bench.cli",
    "services.predictor.cli",  # trace collect; predictor train / eval / bench-search
    "services.simulator.cli",
    "services.predictor.service_cli",  # extends a `predictor` group registered before it
    "services.doctor.cli",
    "services.docs.cli",  # last: its reference walks every command registered before it
)


class CliError(Exception):
    """A user error: printed as one line, exit code 2."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hintserve", description="Serve offloaded MoE LLMs.")
    subparsers = parser.add_subparsers(dest="command", required=True)
    for name in _COMMAND_MODULES:
        importlib.import_module(name).register(subparsers)
    # Commands that run other commands (`bench all`) get this dispatcher: it sits above their packages.
    parser.set_defaults(run_command=main)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        result = args.func(args)
    except (CliError, FileNotFoundError, ValueError) as exc:
        print(f"hintserve {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
