"""Simulation output: the table (printed and as markdown), the JSON rows, TPOT against cache budget plot."""

from __future__ import annotations

import os

from services.common.report import markdown_table, write_json

HEADERS = (
    "policy",
    "cache GB",
    "TPOT ms",
    "TTFT ms",
    "hit rate",
    "GB/token",
    "blocking ms/tok",
    "link busy",
    "peak GB",
    "bound ms",
    "of bound",
    "of static",
    "note",
)


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.3g}" if value < 10 else f"{value:.1f}"


def _share(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def table(rows: list[dict]) -> str:
    return markdown_table(
        HEADERS,
        [
            (
                r["policy"],
                f"{r['cache_gb']:.3g}",  # 3 significant digits: real models and the demo model alike
                _ms(r["tpot_ms"]),
                _ms(r["ttft_ms"]),
                f"{r['hit_rate']:.2f}",
                f"{r['gb_moved_per_token']:.3g}",
                f"{r['blocking_ms_per_token']:.1f}",
                f"{r['link_busy_share']:.0%}",
                f"{r['peak_memory_gb']:.3g}",
                _ms(r.get("bound_tpot_ms")),
                _share(r.get("of_bound")),
                _share(r.get("of_static_bound")),
                r["note"],
            )
            for r in rows
        ],
    )


def skipped_lines(skipped: list[dict]) -> str:
    return "\n".join(f"- `{s['policy']}` not simulable on this trace: {s['reason']}" for s in skipped)


def write_report(
    result: dict, json_path: str | None, markdown_path: str | None, plot_path: str | None
) -> None:
    if json_path:
        write_json(json_path, result)
    if markdown_path:
        os.makedirs(os.path.dirname(os.path.abspath(markdown_path)), exist_ok=True)
        with open(markdown_path, "w") as f:
            f.write(
                f"# Simulated offload: {result['model_spec']} on {result['hardware']}\n\n{result['setting']}\n\n"
            )
            f.write(table(result["rows"]) + "\n")
            if result["not_simulable"]:
                f.write("\n" + skipped_lines(result["not_simulable"]) + "\n")
    if plot_path:
        plot_tpot(plot_path, result)


def plot_tpot(path: str, result: dict) -> None:
    """FineMoE Fig. 12 style: TPOT against the expert cache budget, one line per policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    by_policy: dict[str, list[dict]] = {}
    for r in result["rows"]:
        if r["tpot_ms"] is not None:
            by_policy.setdefault(r["policy"], []).append(r)
    for policy, rows in by_policy.items():
        if policy == "resident":
            ax.axhline(
                rows[0]["tpot_ms"], color="grey", linestyle="--", label="resident (every expert on the GPU)"
            )
            continue
        rows.sort(key=lambda r: r["cache_gb"])
        ax.plot([r["cache_gb"] for r in rows], [r["tpot_ms"] for r in rows], marker="o", label=policy)
    ax.set_xlabel("expert cache budget (GB)")
    ax.set_ylabel("TPOT (ms)")
    ax.set_yscale("log")
    ax.set_title(f"{result['model_spec']} on {result['hardware']} (simulated)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
