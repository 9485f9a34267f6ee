"""The `hintserve` command line: one subcommand per service or tool."""

from __future__ import annotations

import argparse
import sys

from services.bench import cli as bench_cli
from services.docs import cli as docs_cli
from services.doctor import cli as doctor_cli
from services.engine import cli as engine_cli
from services.engine.demo_model import cli as demo_model_cli
from services.engine.embedded_predictor import use_embedded_predictor
from services.gateway import cli as gateway_cli
from services.predictor import cli as predictor_cli
from services.predictor import service_cli as predictor_service_cli
from services.predictor.embedded import embedded_service
from services.simulator import cli as simulator_cli

# Each module exposes `register(subparsers)` adding its subcommand(s); each parser sets `func`.
_COMMAND_MODULES = (
    engine_cli,
    demo_model_cli,
    gateway_cli,
    bench_cli,
    predictor_cli,  # trace collect; predictor train / eval / bench-search
    simulator_cli,
    predictor_service_cli,  # extends a `predictor` group registered before it
    doctor_cli,
    docs_cli,  # last: its reference walks every command registered before it
)


class CliError(Exception):
    """A user error: printed as one line, exit code 2."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hintserve", description="Serve offloaded MoE LLMs.")
    subparsers = parser.add_subparsers(dest="command", required=True)
    for module in _COMMAND_MODULES:
        module.register(subparsers)
    # Commands that run other commands (`bench all`) get this dispatcher, and `docs generate` the whole parser:
    # both sit above the commands' packages.
    parser.set_defaults(run_command=main, build_parser=build_parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    use_embedded_predictor(embedded_service)  # engines without --redis-url run it (the engine cannot import it)
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
