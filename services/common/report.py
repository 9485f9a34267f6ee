"""Benchmark outputs: JSON, a markdown table and a PNG plot, written the same way by every benchmark."""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
from collections.abc import Sequence

import torch

from services.common.cpu import cpu_info


def machine_description() -> str:
    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}"
    cpu = cpu_info()
    features = "+".join(name for name, present in cpu["features"].items() if present) or platform.machine()
    return f"{cpu['model']} x{cpu['cores']} ({features}), torch {torch.__version__}"


def run_header() -> dict[str, str]:
    return {"machine": machine_description(), "date": dt.date.today().isoformat()}


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    def fmt(v: object) -> str:
        return f"{v:.2f}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(fmt(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def write_json(path: str, payload: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(payload, f, indent=2)
        f.write("\n")


def write_markdown(path: str, title: str, header: dict[str, str], table: str) -> None:
    with open(path, "w") as f:
        f.write(f"# {title}\n\nMachine: {header['machine']}. Date: {header['date']}.\n\n{table}\n")


def bar_plot(path: str, title: str, labels: Sequence[str], series: dict[str, Sequence[float]], ylabel: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / max(1, len(series))
    for i, (name, values) in enumerate(series.items()):
        ax.bar([x + i * width for x in range(len(labels))], values, width, label=name)
    ax.set_xticks([x + width * (len(series) - 1) / 2 for x in range(len(labels))], labels)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
