"""`hintserve demo-model build|stats`: build the small MoE demo model the project serves offline."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _positive(kind: type):
    def parse(text: str):
        value = kind(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be positive: {text}")
        return value

    return parse


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `demo-model` command with `build` and `stats` subcommands."""
    parser = subparsers.add_parser("demo-model", help="build the small demo MoE model (CPU, no downloads)")
    sub = parser.add_subparsers(dest="demo_command", required=True)

    build = sub.add_parser(
        "build",
        help="corpus -> BPE tokenizer -> train Mixtral-style MoE -> HF folder + stats; or, with --shape and "
        "--random, random weights at a real family's shapes (speed benchmarks)",
    )
    build.add_argument("--out", required=True, type=Path, help="output folder (e.g. models/demo-moe)")
    build.add_argument(
        "--minutes", type=_positive(float), default=8.0, help="training wall-clock budget (default 8)"
    )
    build.add_argument("--seed", type=int, default=0)
    build.add_argument("--init-from", type=Path, default=None, help="continue training a model built earlier")
    build.add_argument(
        "--prompts-dir",
        default=None,
        help="GSM8K/HumanEval jsonl folder (default ../shared/data/prompts/gsm8k_humaneval if present)",
    )
    build.add_argument("--vocab-size", type=_positive(int), default=8000)
    build.add_argument(
        "--max-corpus-mb", type=_positive(float), default=20.0, help="cap on corpus text (default 20)"
    )
    build.add_argument("--batch-size", type=int, default=0, help="0: pick from a short throughput probe")
    build.add_argument("--lr", type=_positive(float), default=3e-3)
    build.add_argument(
        "--precision",
        choices=("auto", "bf16", "fp32"),
        default="auto",
        help="auto: bf16 autocast only on CPUs with native bf16",
    )
    build.add_argument(
        "--max-steps", type=_positive(int), default=None, help="stop after N steps (smoke runs)"
    )
    build.add_argument(
        "--shape",
        choices=("qwen3-30b-a3b", "mixtral-8x7b", "deepseek-v2-lite"),
        default=None,
        help="with --random: that family's real per-layer shapes (no training)",
    )
    build.add_argument("--random", action="store_true", help="random weights instead of training (needs --shape)")
    build.add_argument("--layers", type=_positive(int), default=4, help="--shape builds: layers (default 4)")
    build.add_argument(
        "--experts", type=_positive(int), default=None, help="--shape builds: fewer routed experts (tests)"
    )
    build.set_defaults(func=run_build)

    stats = sub.add_parser("stats", help="validation perplexity and routing statistics of a built model")
    stats.add_argument("--model", required=True, type=Path, help="folder written by `demo-model build`")
    stats.set_defaults(func=run_stats)


def run_build(args: argparse.Namespace) -> int:
    if args.shape or args.random:
        return _run_random_build(args)
    from .train import TrainSettings, build

    settings = TrainSettings(
        minutes=args.minutes,
        seed=args.seed,
        batch_size=args.batch_size,
        lr=args.lr,
        precision=args.precision,
        max_steps=args.max_steps,
        init_from=str(args.init_from) if args.init_from else None,
    )
    info = build(
        args.out,
        settings,
        vocab_size=args.vocab_size,
        max_corpus_mb=args.max_corpus_mb,
        prompts_dir=args.prompts_dir,
    )
    print(f"wrote {args.out} in {info['total_s']:.0f}s")
    return 0


def _run_random_build(args: argparse.Namespace) -> int:
    from .random_model import build_random

    if not (args.shape and args.random):
        raise ValueError("--shape builds random weights only: give both --shape and --random")
    info = build_random(args.out, args.shape, args.layers, args.vocab_size, args.experts, args.seed)
    print(f"wrote {args.out}: {args.shape}, {args.layers} layers, {info['params'] / 1e9:.2f}B params, "
          f"{info['bytes'] / 1e9:.2f} GB bf16 in {info['build_s']:.0f}s")
    return 0


def recorded_split(model_dir: Path) -> tuple[list, dict]:
    """The validation documents recorded at build time (rebuilt deterministically) and the build settings."""
    from .corpus import build_corpus, resolve_prompts_dir
    from .train import BUILD_FILE

    if not (model_dir / "config.json").is_file():
        raise FileNotFoundError(f"no model in {model_dir} (config.json missing)")
    info_path = model_dir / BUILD_FILE
    info = json.loads(info_path.read_text()) if info_path.is_file() else {}
    corpus_info = info.get("corpus", {})
    if "prompts_dir" in corpus_info:
        prompts = corpus_info["prompts_dir"]
        prompts_dir = resolve_prompts_dir(prompts) if prompts else None
    else:
        prompts_dir = resolve_prompts_dir(None)
    corpus = build_corpus(
        corpus_info.get("seed", 0), int(corpus_info.get("max_corpus_mb", 20.0) * 1e6), prompts_dir
    )
    recorded = corpus_info.get("val_docs")
    if recorded and [d.name for d in corpus.val] != recorded:
        print(
            "warning: validation split differs from the one recorded at build time (other Python?)",
            file=sys.stderr,
        )
    return corpus.val, info.get("settings", {})


def run_stats(args: argparse.Namespace) -> int:
    """Rebuild the validation split recorded at build time and recompute the statistics."""
    from .stats import STATS_FILE, format_table, stats_for_dir

    model_dir: Path = args.model
    val, settings = recorded_split(model_dir)
    stats = stats_for_dir(model_dir, val, settings.get("seq_len", 256), settings.get("eval_windows", 64))
    print(format_table(stats))
    print(f"wrote {model_dir / STATS_FILE}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m services.engine.demo_model.cli build ...` (same as `hintserve demo-model build ...`)."""
    parser = argparse.ArgumentParser(prog="demo-model")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["demo-model", *(argv if argv is not None else sys.argv[1:])])
    try:
        return int(args.func(args) or 0)
    except (FileNotFoundError, ValueError) as exc:
        print(f"demo-model: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
