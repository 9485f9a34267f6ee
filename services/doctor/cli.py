"""`hintserve doctor`: run first on a new machine. Probes the machine (and a model directory, without loading
it), then recommends the expert cache size and policy as flags to copy. Under 15 s; `--json` for tools."""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379"


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"


def collect(args: argparse.Namespace) -> dict[str, Any]:
    """Every probe's result and the recommendation, as one JSON-ready dict."""
    from services.common.cpu import cpu_info
    from services.doctor import machine
    from services.engine.host_allocator import huge_page_status

    start = time.perf_counter()
    model = None
    if args.model:
        from services.doctor.model_check import check_model

        model = check_model(args.model)  # bad input fails first, before the slow probes
    cpu = cpu_info()
    report: dict[str, Any] = {
        "build": machine.builds(), "cuda": machine.cuda_devices(), "cpu": cpu,
        "native_kernels": machine.native_kernels(), "huge_pages": huge_page_status(),
        "pinned_memory": machine.pinned_memory(),
        "host_memory": machine.host_memory_gb(), "host_bandwidth_gbps": machine.host_bandwidth_gbps(),
        "link_gbps": machine.link_bandwidth_gbps(), "redis": machine.redis_status(args.redis_url),
    }
    if model is not None:
        from services.doctor.recommend import recommend

        device_gb = args.gpu_memory_gb or (report["cuda"][0]["memory_gb"] if report["cuda"] else None)
        planned = "described" if args.gpu_memory_gb else ("found" if device_gb else "none")
        rec = recommend(model, device_gb, report["host_memory"]["available_gb"], report["host_bandwidth_gbps"],
                        args.link_gbps or report["link_gbps"], cpu["cores"], cpu["features"]["avx512"])
        report["model"] = model.as_dict()
        report["recommendation"] = rec.as_dict() | {"device": planned, "device_gb": device_gb}
    report["seconds"] = time.perf_counter() - start
    return report


def _target(rec: dict[str, Any]) -> str:
    if rec["device"] == "described":
        return f"for the described {rec['device_gb']:g} GB GPU"
    return "for the GPU found" if rec["device"] == "found" else "for this CPU-only machine"


def render(report: dict[str, Any]) -> str:
    b, cpu, k, pin, mem = (report[k] for k in ("build", "cpu", "native_kernels", "pinned_memory", "host_memory"))
    huge = report["huge_pages"]
    features = ", ".join(f"{name.upper() if name != 'avx512' else 'AVX-512'} {_yes(on)}"
                         for name, on in cpu["features"].items())
    cuda = "; ".join(f"{d['index']}: {d['name']}, {d['memory_gb']:.1f} GB, sm {d['capability']}"
                     for d in report["cuda"]) or "no device"
    redis = report["redis"]
    lines = [
        f"python       {b['python']}, torch {b['torch']} (CUDA build: {b['torch_cuda'] or 'none'})",
        f"cuda         {cuda}",
        f"cpu          {cpu['model']}, {cpu['cores']} cores; {features}",
        f"kernels      {k['runs'] + ' ' if k['built'] else 'not built '}({k['why']})",
        "huge pages   " + (f"weights on huge pages (THP mode {huge['mode']!r})" if huge["weights"]
                           else f"weights on 4 KB pages: {huge['why']} (CPU kernels guide: Huge pages)"),
        f"pinned       {'available' if pin['available'] else 'not available: ' + pin['why']}",
        f"host memory  {mem['total_gb']:.1f} GB, {mem['available_gb']:.1f} GB available; "
        f"copy bandwidth {report['host_bandwidth_gbps']:.1f} GB/s",
        "link         " + (f"{report['link_gbps']:.1f} GB/s host to device (pinned)" if report["link_gbps"]
                             else "not measured (no CUDA device)"),
        f"redis        {redis['url']} " + (f"reachable (ping {redis['ping_ms']:.1f} ms)" if redis["reachable"]
                                           else f"not reachable: {redis['why']}"),
    ]
    if "model" in report:
        m, rec = report["model"], report["recommendation"]
        lines += [
            f"model        {m['path']}: {m['family']}, {m['moe_layers']} MoE layers x {m['experts_per_layer']} "
            f"experts (top-{m['top_k']}), {m['format']}, {m['expert_layout']}; {m['total_bytes'] / 1e9:.3f} GB, "
            f"experts {m['all_experts_bytes'] / 1e9:.3f} GB ({m['expert_bytes'] / 1e6:.2f} MB each)",
            "",
            f"recommended ({_target(rec)}):",
            f"  hintserve serve {rec['flags']}",
            f"  why: {rec['why']}",
        ]
    else:
        lines += ["", "pass --model DIR for that model's recommended expert cache and policy"]
    lines.append(f"(probes took {report['seconds']:.1f} s)")
    return "\n".join(lines)


def _doctor(args: argparse.Namespace) -> int:
    for name in ("gpu_memory_gb", "link_gbps"):
        value = getattr(args, name)
        if value is not None and value <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be positive, got {value}")
    # Resolved here, not as the parser's default, so the generated CLI reference does not depend on the env.
    args.redis_url = args.redis_url or os.environ.get("HINTSERVE_REDIS_URL") or DEFAULT_REDIS_URL
    report = collect(args)
    print(json.dumps(report, indent=2) if args.json else render(report))
    return 0


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("doctor", help="check this machine (and a model directory) and recommend flags")
    p.add_argument("--model", help="model directory to check (config.json and safetensors headers only)")
    p.add_argument("--redis-url", help=f"Redis to ping (default: $HINTSERVE_REDIS_URL, else {DEFAULT_REDIS_URL})")
    p.add_argument("--gpu-memory-gb", type=float, help="plan for a GPU of this size instead of the one found")
    p.add_argument("--link-gbps", type=float, help="plan for this host-to-device bandwidth instead of measuring")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=_doctor)
