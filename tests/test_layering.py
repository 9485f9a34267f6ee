"""No import runs from a lower package to a higher one (every import in every module, function-level too),
and none hides by name: importlib / __import__ calls are read as imports, and no "package.module:attr"
import string names another package.

Layers, lowest first: services.common < services.engine < services.predictor < services.gateway <
services.bench, services.simulator < services.doctor, services.docs < services.cli (bench and simulator are
peers; the command line registers every command and hands docs its parser). The load generator
imports nothing from services but services.common.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LAYERS: dict[str, int] = {
    "services.common": 0,
    "services.engine": 1,
    "services.predictor": 2,
    "services.gateway": 3,
    "services.bench": 4,
    "services.simulator": 4,
    "services.doctor": 5,
    "services.docs": 5,
    "services.cli": 6,
}


def _package(module: str) -> str | None:
    """The layered package `module` belongs to (longest prefix), or None outside services."""
    for name in sorted(LAYERS, key=len, reverse=True):
        if module == name or module.startswith(name + "."):
            return name
    return None


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in the file, relative ones resolved."""
    tree = ast.parse(path.read_text(), str(path))
    here = _module_name(path).split(".")
    is_package = path.name == "__init__.py"
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here if is_package else here[:-1]
                base = base[: len(base) - (node.level - 1)]
                module = ".".join([*base, node.module] if node.module else base)
            else:
                module = node.module or ""
            out.append((node.lineno, module))
            # `from services import cli` names a module too
            out += [(node.lineno, f"{module}.{alias.name}") for alias in node.names
                    if not _package(module) and _package(f"{module}.{alias.name}")]
    return out


_IMPORT_CALLS = {"import_module", "__import__"}
_IMPORT_STRING = re.compile(r"^(services|loadgen)(\.\w+)+(:\w+)?$")
# Calls whose module comes from the user at run time (nothing in the code names it): allowed, with why.
USER_SUPPLIED = {
    "services/predictor/hub.py": "--predictor package.module:Class, a user's own predictor",
    "services/common/protos.py": "the modules it has just generated from protos/*.proto, its own package",
}


def _module_strings(tree: ast.Module) -> dict[str, list[str]]:
    """Module-level names bound to a string, or to a tuple or list of strings."""
    out: dict[str, list[str]] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            value = node.value
            items = value.elts if isinstance(value, (ast.Tuple, ast.List)) else [value]
            if all(isinstance(v, ast.Constant) and isinstance(v.value, str) for v in items):
                out[node.targets[0].id] = [v.value for v in items]  # type: ignore[attr-defined]
    return out


def _loaded_by_name(path: Path) -> tuple[list[tuple[int, str]], list[str]]:
    """(line, module) of every importlib.import_module / __import__ call the code names (a literal, an
    f-string's literal start, a module-level constant), and the calls whose module cannot be read."""
    tree = ast.parse(path.read_text(), str(path))
    constants = _module_strings(tree)
    for loop in ast.walk(tree):  # `for name in NAMES: import_module(name)` reads NAMES
        if isinstance(loop, ast.For) and isinstance(loop.target, ast.Name) and isinstance(loop.iter, ast.Name):
            if loop.iter.id in constants:
                constants[loop.target.id] = constants[loop.iter.id]
    where = str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)
    found, unread = [], []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or not node.args:
            continue
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
        if name not in _IMPORT_CALLS:
            continue
        arg = node.args[0]
        if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
            found.append((node.lineno, arg.value))
        elif isinstance(arg, ast.JoinedStr) and arg.values:
            head = arg.values[0]
            if isinstance(head, ast.Constant):
                found.append((node.lineno, str(head.value).rstrip(".")))
            elif isinstance(head, ast.FormattedValue) and isinstance(head.value, ast.Name) \
                    and head.value.id == "__name__":
                found.append((node.lineno, _module_name(path)))
            else:
                unread.append(f"{where}:{node.lineno}")
        elif isinstance(arg, ast.Name) and arg.id in constants:
            found += [(node.lineno, module) for module in constants[arg.id]]
        else:
            unread.append(f"{where}:{node.lineno}")
    return found, unread


def _import_strings(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every "package.module[:attr]" string naming a module of services or loadgen that
    exists (a module to load by name; `-m` arguments of a command line are strings of another kind)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and _IMPORT_STRING.match(node.value):
            module, _, attr = node.value.partition(":")
            file = ROOT / module.replace(".", "/")
            if attr and (file.with_suffix(".py").is_file() or (file / "__init__.py").is_file()):
                out.append((node.lineno, module))
    return out


def _sources() -> list[Path]:
    paths = sorted((ROOT / "services").rglob("*.py")) + sorted((ROOT / "loadgen").rglob("*.py"))
    return [p for p in paths if "_generated" not in p.parts and "generated" not in p.parts]


def violations() -> list[str]:
    found = []
    for path in _sources():
        importer = _module_name(path)
        own = _package(importer)
        by_name = _loaded_by_name(path)[0] + _import_strings(path)
        for line, module in _imports(path) + by_name:
            target = _package(module)
            if target is None or target == own:
                continue
            where = f"{path.relative_to(ROOT)}:{line} imports {module}"
            if own is None:  # loadgen
                if target != "services.common":
                    found.append(where)
            elif LAYERS[target] > LAYERS[own]:
                found.append(where)
    return found


def test_no_lower_package_imports_a_higher_one() -> None:
    bad = violations()
    assert not bad, "imports against the layering:\n" + "\n".join(bad)


def test_what_is_loaded_by_name_is_named_in_the_code() -> None:
    unread = [where for path in _sources() for where in _loaded_by_name(path)[1]
              if str(path.relative_to(ROOT)) not in USER_SUPPLIED]
    assert not unread, "imports by a name the code does not spell (so the layering cannot see them):\n" + \
        "\n".join(unread)


def test_no_import_string_names_another_package() -> None:
    bad = [f"{path.relative_to(ROOT)}:{line} names {module}" for path in _sources()
           for line, module in _import_strings(path) if _package(module) != _package(_module_name(path))]
    assert not bad, "import strings naming another package (pass the object in instead):\n" + "\n".join(bad)


def test_the_checks_see_an_import_by_name(tmp_path: Path) -> None:
    source = tmp_path / "probe.py"
    source.write_text('import importlib\nNAMES = ("services.docs.cli",)\nLINK = "services.predictor.embedded:f"\n'
                      'for n in NAMES:\n    importlib.import_module(n)\nimportlib.import_module(f"services.gateway.{n}")\n'
                      '__import__(input())\n')
    found, unread = _loaded_by_name(source)
    assert sorted(m for _, m in found) == ["services.docs.cli", "services.gateway"]
    assert len(unread) == 1
    assert [m for _, m in _import_strings(source)] == ["services.predictor.embedded"]
