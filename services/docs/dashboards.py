"""What each Grafana panel shows, read from the provisioned dashboard's own titles and descriptions."""

from __future__ import annotations

import json
from pathlib import Path

from services.common.report import markdown_table


def render(dashboard: Path) -> str:
    """One table per dashboard row: panel title and its description."""
    panels = json.loads(dashboard.read_text()).get("panels", [])
    out: list[str] = []
    rows: list[tuple[str, str]] = []

    def flush() -> None:
        if rows:
            out.extend([markdown_table(("panel", "what it shows"), rows), ""])
            rows.clear()

    for panel in panels:
        if panel.get("type") == "row":
            flush()
            out.extend([f"**{panel.get('title', '')}**", ""])
            continue
        rows.append((f"{panel.get('title', '')}", " ".join((panel.get("description") or "").split())
                     .replace("|", "\\|")))
    flush()
    return "\n".join(out).rstrip()
