"""The CLI reference: every subcommand and flag, walked from the argparse parsers themselves."""

from __future__ import annotations

import argparse
from collections.abc import Iterator

from services.common.report import markdown_table


def subcommands(parser: argparse.ArgumentParser, path: tuple[str, ...] = (), summary: str = "") -> Iterator[
        tuple[tuple[str, ...], argparse.ArgumentParser, str]]:
    """(command path, parser, one-line help) for every parser under `parser`, depth first, in registration
    order."""
    yield path, parser, summary
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help or "" for a in action._choices_actions}
            for name, sub in action.choices.items():
                yield from subcommands(sub, (*path, name), helps.get(name, ""))


def options(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """The parser's own flags and positionals (not --help, not its subcommand dispatcher)."""
    return [a for a in parser._actions
            if not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction)) and a.dest != "help"]


def _default(action: argparse.Action) -> str:
    if action.required:
        return "required"
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)) or action.default is None:
        return ""
    if action.default is argparse.SUPPRESS:
        return ""
    return f"`{action.default}`"


def _cell(text: str) -> str:
    # A table cell: one line, pipes escaped.
    return " ".join(str(text).split()).replace("|", "\\|")


def _help(action: argparse.Action) -> str:
    text = action.help if action.help not in (None, argparse.SUPPRESS) else ""
    if action.choices and not isinstance(action.choices, dict):
        text = f"{text} (one of: {', '.join(f'`{c}`' for c in action.choices)})".strip()
    return _cell(text)


def _name(action: argparse.Action) -> str:
    if not action.option_strings:
        return f"`{action.dest}`"
    return ", ".join(f"`{s}`" for s in action.option_strings)


def render(parser: argparse.ArgumentParser, prog: str = "hintserve") -> str:
    """Markdown: one section per command that runs something, its usage and a table of its flags."""
    out = ["# CLI reference", "",
           "Generated from the argument parsers by `hintserve docs generate`; do not edit by hand.", ""]
    for path, sub, summary in subcommands(parser):
        if not path:
            continue
        out += [f"## `{' '.join((prog, *path))}`", ""]
        out += [_cell(text) + "\n" for text in (summary, sub.description) if text]
        rows = [(_name(a), _default(a), _help(a)) for a in options(sub)]
        if rows:
            out += [markdown_table(("flag", "default", "meaning"), rows), ""]
        else:
            out += ["Subcommands only (below).", ""]
    return "\n".join(out)
