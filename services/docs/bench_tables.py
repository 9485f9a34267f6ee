"""Benchmark tables from the saved results (bench/results/*.json), never typed by hand.

Generic over result files: a file's top-level scalars (and dicts of scalars) are its run record; each list of
records (its rows) is a table; a dict of records (one per case) is a table with the case as first column. The
pages ask for views of them with directives (see `render_directive`)."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from services.common.report import markdown_table

Scalar = str | int | float | bool | None


def _is_scalar(v: Any) -> bool:
    return v is None or isinstance(v, (str, int, float, bool))


def _is_records(v: Any) -> bool:
    return isinstance(v, list) and bool(v) and all(isinstance(r, dict) for r in v)


def _is_case_map(v: Any) -> bool:
    return isinstance(v, dict) and bool(v) and all(isinstance(r, dict) for r in v.values()) and \
        any(_is_scalar(x) for r in v.values() for x in r.values())


def fmt(v: Any) -> str:
    """One number format for every generated figure: 3 significant digits, no trailing zeros games."""
    if isinstance(v, bool) or v is None:
        return "" if v is None else ("yes" if v else "no")
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:,.0f}"
    if isinstance(v, int):
        return f"{v:,}" if abs(v) >= 10000 else str(v)
    return " ".join(str(v).split()).replace("|", "\\|")


def load(results: Path, name: str) -> dict[str, Any]:
    path = results / name
    if not path.is_file():
        raise FileNotFoundError(f"no saved result {path}")
    data = json.loads(path.read_text())
    if not isinstance(data, dict):
        return {"rows": data}
    return {"cases": data} if _is_case_map(data) and all(not _is_scalar(v) for v in data.values()) else data


def record(data: dict[str, Any]) -> list[tuple[str, str]]:
    """(key, value) of the run record: top-level scalars, then one level of dicts of scalars (key.sub)."""
    out = [(k, fmt(v)) for k, v in data.items() if _is_scalar(v)]
    for k, v in data.items():
        if isinstance(v, dict) and not _is_case_map(v):
            out += [(f"{k}.{s}", fmt(x)) for s, x in v.items() if _is_scalar(x)]
    return out


def tables(data: dict[str, Any], prefix: str = "") -> list[tuple[str, list[str], list[list[str]]]]:
    """(name, headers, rows) for every list of records and every dict of records in the file (and in its
    dicts, one level down: `medians.vllm`)."""
    out = []
    for key, value in data.items():
        key = f"{prefix}{key}"
        if isinstance(value, dict) and not prefix and not _is_case_map(value):
            out += tables(value, prefix=f"{key}.")
            continue
        if _is_records(value):
            records = value
            first: list[str] = []
        elif _is_case_map(value):
            records = [{"case": case, **r} for case, r in value.items()]
            first = ["case"]
        else:
            continue
        headers = first + [h for h in dict.fromkeys(k for r in records for k in r) if h not in first
                           and all(_is_scalar(r.get(h)) for r in records)]
        out.append((key, headers, [[fmt(r.get(h)) for h in headers] for r in records]))
    return out


def run_machine(data: dict[str, Any]) -> str:
    return fmt(data.get("machine") or (f"simulated {data['hardware']}" if "hardware" in data else "not recorded"))


def run_date(data: dict[str, Any]) -> str:
    dated = re.search(r"\b(\d{4}-\d\d-\d\d)\b", str(data.get("setting", "")))  # simulate records it there
    return fmt(data.get("date") or (dated[1] if dated else "not recorded"))


def run_line(name: str, data: dict[str, Any]) -> str:
    return f"Source: `bench/results/{name}`; machine: {run_machine(data)}; date: {run_date(data)}."


def _where(rows: list[dict[str, Any]], where: str) -> list[dict[str, Any]]:
    for cond in filter(None, where.split(",")):
        key, _, want = cond.partition("=")
        rows = [r for r in rows if fmt(r.get(key)) == want or str(r.get(key)) == want]
    return rows


def pivot(rows: list[dict[str, Any]], row_key: str, col_key: str, value: str, bold: str = "",
          unranked: Sequence[str] = ()) -> str:
    """rows x columns of one value (e.g. policy x batch of TPOT); `bold=min|max` marks each column's best
    among the rows not named in `unranked` (references such as `resident` and the bounds)."""
    row_names = list(dict.fromkeys(fmt(r[row_key]) for r in rows))
    col_names = list(dict.fromkeys(fmt(r[col_key]) for r in rows))
    cells = {(fmt(r[row_key]), fmt(r[col_key])): r.get(value) for r in rows}
    best = {}
    if bold in ("min", "max"):
        pick = min if bold == "min" else max
        for c in col_names:
            values = [v for (rr, cc), v in cells.items()
                      if cc == c and rr not in unranked and isinstance(v, (int, float))]
            best[c] = pick(values) if values else None
    table = []
    for name in row_names:
        line = [name]
        for c in col_names:
            v = cells.get((name, c))
            ranked = v is not None and name not in unranked and v == best.get(c)
            line.append(f"**{fmt(v)}**" if ranked else fmt(v))
        table.append(line)
    return markdown_table([f"{row_key} \\ {col_key}", *col_names], table)


def select(rows: list[dict[str, Any]], columns: Sequence[str]) -> str:
    return markdown_table(list(columns), [[fmt(r.get(c)) for c in columns] for r in rows])


def render_directive(results: Path, directive: str) -> str:
    """`KIND FILE key=value ...`:
    - `run FILE`: where the figures come from (file, machine, date);
    - `record FILE [keys=a,b]`: the run record as a two-column table;
    - `table FILE [list=rows] [columns=a,b] [where=k=v;...]`: records as a table;
    - `pivot FILE rows=K cols=K value=K [list=rows] [where=...] [bold=min|max] [unranked=a,b]`."""
    kind, name, *args = directive.split()
    opts = dict(a.split("=", 1) for a in args)
    data = load(results, name)
    if kind == "run":
        return run_line(name, data)
    if kind == "record":
        keys = opts.get("keys", "").split(",") if "keys" in opts else None
        pairs = [(k, v) for k, v in record(data) if keys is None or k in keys]
        return markdown_table(("setting", "value"), pairs)
    source = data
    for part in opts.get("list", "rows").split("."):
        if not isinstance(source, dict) or part not in source:
            raise ValueError(f"{name} has no list {opts.get('list', 'rows')!r}")
        source = source[part]
    rows = [{"case": k, **v} for k, v in source.items()] if isinstance(source, dict) else list(source)
    rows = _where(rows, opts.get("where", "").replace(";", ","))
    if kind == "table":
        columns = opts["columns"].split(",") if "columns" in opts else [
            k for k in dict.fromkeys(k for r in rows for k in r) if all(_is_scalar(r.get(k)) for r in rows)]
        return select(rows, columns)
    if kind == "pivot":
        unranked = [u for u in opts.get("unranked", "").split(",") if u]
        return pivot(rows, opts["rows"], opts["cols"], opts["value"], opts.get("bold", ""), unranked)
    raise ValueError(f"unknown generated-block kind {kind!r}: use run, record, table or pivot")


def render_all(results: Path) -> str:
    """The benchmark results reference page: every saved JSON, its run record and all its tables."""
    out = ["# Saved benchmark results", "",
           "Every `bench/results/*.json`, rendered by `hintserve docs generate`; do not edit by hand. The "
           "benchmark pages say what each measures and the command that reproduces it.", ""]
    for path in sorted(results.glob("*.json")):
        try:
            data = load(results, path.name)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ValueError(f"{path}: not JSON ({exc})") from None
        out += [f"## {path.stem}", "", run_line(path.name, data), ""]
        pairs = [(k, v) for k, v in record(data) if k not in ("machine", "date")]
        if pairs:
            out += [markdown_table(("setting", "value"), pairs), ""]
        for key, headers, rows in tables(data):
            out += [f"**{key}**", "", markdown_table(headers, rows), ""]
    return "\n".join(out)
