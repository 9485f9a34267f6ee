"""Latency CDFs (TTFT, TPOT, E2EL), one panel each, in the style of FineMoE's Fig. 11."""

from __future__ import annotations

from pathlib import Path

import numpy as np

PANELS = (("ttfts", "TTFT", "ttft"), ("tpots", "TPOT", "tpot"), ("e2els", "E2E latency", "e2el"))


def plot_cdfs(runs: dict[str, dict], path: str | Path, slos: dict[str, float] | None = None,
              title: str = "") -> None:
    """runs: label -> a replay result (its `ttfts`/`tpots`/`e2els` lists, in s). Several runs (say one per
    policy) overlay in each panel. SLOs (ms) are drawn as dashed vertical lines."""
    import matplotlib

    matplotlib.use("Agg")  # headless: never needs a display
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(PANELS), figsize=(4.2 * len(PANELS), 3.4))
    for ax, (key, label, slo_key) in zip(axes, PANELS):
        for run_label, result in runs.items():
            values = np.sort(np.asarray(result.get(key) or [], dtype=float) * 1000.0)
            if key == "tpots":
                values = values[values > 0]  # single-token outputs have no TPOT
            if values.size:
                ax.step(values, np.arange(1, values.size + 1) / values.size, where="post", label=run_label)
        if slos and slo_key in slos:
            ax.axvline(slos[slo_key], color="grey", linestyle="--", linewidth=1, label=f"SLO {slos[slo_key]:g} ms")
        ax.set_xlabel(f"{label} (ms)")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("CDF")
    axes[0].legend(fontsize=8, loc="lower right")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
