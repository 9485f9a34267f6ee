"""`hintserve simulate`: replay a routing trace through every offload policy on a real-size model spec."""

from __future__ import annotations

import argparse
import datetime as dt
import os

from services.engine.expert_format import DEFAULT_GROUP_SIZE, EXPERT_DTYPES, GROUP_SIZES


def _budgets(text: str) -> list[float] | None:
    if text == "auto":
        return None
    try:
        out = [float(t) for t in text.split(",") if t]
    except ValueError:
        raise ValueError(f"--cache-gb expects comma-separated GB figures or auto, got {text!r}") from None
    if not out or any(v <= 0 for v in out):
        raise ValueError(f"--cache-gb figures must be positive, got {text!r}")
    return out


def calibration_markdown() -> str:
    """The published figures the simulator reproduces (a table), then those it does not and why."""
    from services.common.report import markdown_table
    from services.simulator.calibration import MISMATCHES, all_figures
    from services.simulator.host_calibration import HYBRID_NOT_REPRODUCED, hybrid_figures

    table = markdown_table(
        ("source", "figure", "published", "simulated", "unit", "error"),
        [(f.source, f.what, f.published, f.simulated, f.unit, f"{f.error:+.1%}")
         for f in all_figures() + hybrid_figures()],
    )
    reasons = [f"- not reproduced: {what}: {why}" for what, why in {**MISMATCHES, **HYBRID_NOT_REPRODUCED}.items()]
    return "\n".join([table, *reasons])


def _calibration() -> int:
    print(calibration_markdown())
    return 0


def _engine_check(model_dir: str, json_path: str | None) -> int:
    """The engine-agreement test's comparison, as a command (docs/benchmarks/simulator.md's figures)."""
    import dataclasses

    from services.common.report import markdown_table, run_header, write_json
    from services.simulator.engine_agreement import compare_with_engine

    if not os.path.isfile(os.path.join(model_dir, "config.json")):
        raise FileNotFoundError(f"no model (config.json) in {model_dir}")
    rows, prices = compare_with_engine(model_dir)
    print(
        markdown_table(
            ("policy", "engine TPOT ms", "simulated TPOT ms", "error", "simulated hit rate"),
            [
                (r.policy, r.engine_tpot_ms, r.sim_tpot_ms, f"{r.tpot_error:+.1%}", r.sim_hit_rate)
                for r in rows
            ],
        )
    )
    print(f"measured: {prices}")
    if json_path:
        write_json(
            json_path,
            {
                **run_header(),
                "model": model_dir,
                "prices": prices,
                "rows": [dataclasses.asdict(r) | {"tpot_error": r.tpot_error} for r in rows],
            },
        )
    return 0


def _simulate(args: argparse.Namespace) -> int:
    if args.calibration:
        return _calibration()
    if args.engine_check:
        return _engine_check(args.engine_check, args.json)
    from services.bench.cli_args import parse_policies
    from services.engine.offload.policies import get_policy
    from services.predictor.traces import load_traces
    from services.simulator.hardware import RooflineCost, get_hardware
    from services.simulator.host import get_host
    from services.simulator.model_specs import get_model_spec
    from services.simulator.report import skipped_lines, table, write_report
    from services.simulator.sweep import default_budgets_gb, run_sweep
    from services.simulator.workload import Workload

    if not args.trace:
        raise ValueError("--trace is required (a routing trace file or directory), or pass --calibration")
    if args.batch < 1 or args.prompt_tokens < 0 or args.warmup_steps < 0 or (args.prefetch_distance or 1) < 1:
        raise ValueError(
            "--batch and --prefetch-distance must be >= 1, --prompt-tokens and --warmup-steps >= 0"
        )
    if args.hint_latency_ms < 0 or (args.link_gbps is not None and args.link_gbps <= 0):
        raise ValueError("--hint-latency-ms must be >= 0 and --link-gbps positive")
    from services.engine.offload.eviction import EVICTION_POLICIES

    if args.eviction is not None and args.eviction not in EVICTION_POLICIES:
        raise ValueError(
            f"unknown eviction policy {args.eviction!r}; choose from: {', '.join(EVICTION_POLICIES)}"
        )
    spec = get_model_spec(args.model_spec)
    if args.expert_dtype != "auto":
        from dataclasses import replace

        from services.simulator.model_specs import engine_expert_precision

        precision = engine_expert_precision(args.expert_dtype, args.expert_group_size, spec.hidden_size,
                                            spec.moe_intermediate_size)
        spec = replace(spec, expert_precision=precision, description=f"{spec.description}, experts {precision.name}")
    hw = get_hardware(args.hardware)
    host = get_host(args.host)
    if args.link_gbps is not None:
        hw = hw.with_link(args.link_gbps)
    policies = [get_policy(name) for name in parse_policies(args.policies)]
    budgets = _budgets(args.cache_gb) or default_budgets_gb(spec, hw)
    workload = Workload(load_traces(args.trace), spec, args.batch, args.prompt_tokens)
    if args.warmup_steps >= len(workload.steps):
        raise ValueError(
            f"--warmup-steps {args.warmup_steps} leaves none of the trace's {len(workload.steps)} steps"
        )
    hot_set_from = args.hot_set_from or ("warmup" if args.warmup_steps else "trace")
    if hot_set_from == "warmup" and not args.warmup_steps:
        raise ValueError("--hot-set-from warmup counts static hot sets on the --warmup-steps: give --warmup-steps N")
    rows, skipped = run_sweep(
        workload,
        policies,
        budgets,
        RooflineCost(spec, hw, host),
        hw,
        args.prefetch_distance,
        args.hint_latency_ms / 1e3,
        args.warmup_steps,
        args.eviction,
        progress=not args.quiet,
        hot_set_steps=args.warmup_steps if hot_set_from == "warmup" else None,
    )
    trace = workload.trace
    setting = (
        f"{spec.description}; {hw.description}, host link {hw.link_gbps:g} GB/s; host {host.description}. "
        f"Trace {trace.source}: "
        f"{len(trace.requests)} requests, {workload.decode_tokens} decode tokens, batch {args.batch}, "
        f"prefetch distance {args.prefetch_distance or 'per policy'}, hint latency {args.hint_latency_ms:g} ms. "
        + (f"The first {args.warmup_steps} steps warm the caches and are left out of the figures; static hot sets "
           f"are counted on {'those steps' if hot_set_from == 'warmup' else 'the whole trace, measured steps too'}. "
           if args.warmup_steps else "Static hot sets are counted on the whole trace, the measured steps too. ")
        + f"GB = 1e9 bytes; TTFT '-' = the trace has no prefill. Simulated {dt.date.today().isoformat()}."
    )
    result = {
        "model_spec": spec.name,
        "hardware": hw.name,
        "link_gbps": hw.link_gbps,
        "host": host.name,
        "trace": args.trace,
        "batch": args.batch,
        "decode_tokens": workload.decode_tokens,
        "warmup_steps": args.warmup_steps,
        "hot_set_from": hot_set_from,
        "setting": setting,
        "rows": rows,
        "not_simulable": skipped,
    }
    print(table(rows))
    if skipped:
        print(skipped_lines(skipped))
    markdown = args.markdown or (os.path.splitext(args.json)[0] + ".md" if args.json else None)
    write_report(result, args.json, markdown, args.plot)
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("simulate", help="trace-driven offload simulation of a real-size MoE model")
    p.add_argument("--model-spec", default="mixtral-8x7b", help="a registered spec or a model directory")
    p.add_argument("--hardware", default="a5000-pcie4", help="GPU and host link profile")
    p.add_argument("--host", default="ddr4-dual",
                   help="host CPU/DRAM profile for host-computed experts: ddr4-dual, ddr4-quad, ddr5-dual, xeon-amx")
    p.add_argument("--trace", help="routing trace: ours (hintserve trace collect) or a real one in ../shared")
    p.add_argument("--policies", default="all", help="comma-separated offload policies, or all")
    p.add_argument(
        "--cache-gb", default="auto", help="expert cache budgets in GB, e.g. 4,8,16 (auto: fit the GPU)"
    )
    p.add_argument("--batch", type=int, default=1, help="requests decoded together")
    p.add_argument(
        "--prompt-tokens",
        type=int,
        default=128,
        help="context assumed for requests whose prefill the trace lacks",
    )
    p.add_argument("--prefetch-distance", type=int, default=None, help="default: each policy's own")
    p.add_argument("--hint-latency-ms", type=float, default=2.0, help="context out -> predictor hints in")
    p.add_argument("--eviction", help="override every policy's eviction (as the engine's --eviction)")
    p.add_argument("--link-gbps", type=float, help="override the profile's host-to-device bandwidth")
    p.add_argument("--expert-dtype", choices=EXPERT_DTYPES, default="auto",
                   help="experts stored as the engine's --expert-dtype (auto: the spec's own precision)")
    p.add_argument("--expert-group-size", type=int, choices=GROUP_SIZES, default=DEFAULT_GROUP_SIZE)
    p.add_argument(
        "--warmup-steps", type=int, default=0, help="steps left out of the figures (cache warm-up)"
    )
    p.add_argument(
        "--hot-set-from", choices=("warmup", "trace"),
        help="where static hot sets (ktransformers, fiddler) are counted: the --warmup-steps, a calibration run "
        "before the measured steps (the default when there are warm-up steps), or the whole trace, measured "
        "steps included (the default without)",
    )
    p.add_argument("--json", help="write the rows here")
    p.add_argument("--markdown", help="markdown table (default: next to --json)")
    p.add_argument("--plot", help="PNG of TPOT against cache budget")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument(
        "--calibration", action="store_true", help="print the published figures the simulator reproduces"
    )
    p.add_argument(
        "--engine-check",
        metavar="MODEL_DIR",
        help="compare simulated and real-engine TPOT on this checkpoint (emulated link), then exit",
    )
    p.set_defaults(func=_simulate)
