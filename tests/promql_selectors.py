"""The vector selectors of a PromQL expression (metric name + label matchers), and whether scraped series
satisfy them. Enough PromQL for dashboards: functions, aggregations with by/without, binary operators with
on/ignoring/group_*, range and offset brackets, string and number literals. Whether the expression parses
at all is promtool's business (tests/test_deploy_prometheus.py)."""

from __future__ import annotations

import re
from dataclasses import dataclass

_TOKEN = re.compile(
    r"""\s*(?:
      (?P<string>"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*')
    | (?P<range>\[[^\]]*\])
    | (?P<number>\d+(?:\.\d+)?(?:[eE][+-]?\d+)?)
    | (?P<ident>[a-zA-Z_:][a-zA-Z0-9_:]*)
    | (?P<punct>=~|!~|!=|==|<=|>=|[{}(),=<>+\-*/%^])
    )""",
    re.VERBOSE,
)
# Keywords followed by a parenthesised list of label names, which are not metrics.
_LABEL_LIST_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right"}
_KEYWORDS = {"and", "or", "unless", "bool", "offset", "atan2"} | _LABEL_LIST_KEYWORDS


@dataclass(frozen=True)
class Matcher:
    label: str
    op: str  # = != =~ !~
    value: str

    def accepts(self, labels: dict[str, str]) -> bool:
        actual = labels.get(self.label, "")  # an absent label matches the empty string, as in Prometheus
        if self.op == "=":
            return actual == self.value
        if self.op == "!=":
            return actual != self.value
        found = re.fullmatch(self.value, actual) is not None
        return found if self.op == "=~" else not found


@dataclass(frozen=True)
class Selector:
    metric: str
    matchers: tuple[Matcher, ...] = ()

    def __str__(self) -> str:
        inner = ",".join(f'{m.label}{m.op}"{m.value}"' for m in self.matchers)
        return f"{self.metric}{{{inner}}}" if inner else self.metric


def _tokens(expr: str) -> list[tuple[str, str]]:
    out, pos = [], 0
    while pos < len(expr):
        if expr[pos:].strip() == "":
            break
        match = _TOKEN.match(expr, pos)
        if match is None or match.end() == pos:
            raise ValueError(f"cannot read PromQL at {expr[pos:]!r}")
        kind = match.lastgroup or ""
        out.append((kind, match.group(kind)))
        pos = match.end()
    return out


def selectors(expr: str) -> list[Selector]:
    tokens = _tokens(expr)
    found: list[Selector] = []
    i = 0
    while i < len(tokens):
        kind, text = tokens[i]
        following = tokens[i + 1][1] if i + 1 < len(tokens) else ""
        if kind == "ident" and text in _LABEL_LIST_KEYWORDS and following == "(":
            i = tokens.index((("punct", ")")), i) + 1  # skip the label list
            continue
        # Functions and aggregations: `f(`, `sum by (...)`, `max without (...)`.
        if kind != "ident" or text in _KEYWORDS or following in ("(", "by", "without"):
            i += 1
            continue
        matchers: list[Matcher] = []
        i += 1
        if following == "{":
            i += 1
            while tokens[i][1] != "}":
                label, op, value = tokens[i][1], tokens[i + 1][1], tokens[i + 2][1]
                matchers.append(Matcher(label, op, value[1:-1].encode().decode("unicode_escape")))
                i += 3
                if tokens[i][1] == ",":
                    i += 1
            i += 1
        found.append(Selector(text, tuple(matchers)))
    return found


def satisfied(selector: Selector, series: list[tuple[str, dict[str, str]]]) -> bool:
    """Whether some scraped (sample name, labels) is selected by `selector`."""
    return any(
        name == selector.metric and all(m.accepts(labels) for m in selector.matchers)
        for name, labels in series
    )
