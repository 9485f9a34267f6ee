"""No import runs from a lower package to a higher one (every import in every module, function-level too).

Layers, lowest first: services.common < services.engine < services.predictor < services.gateway <
services.bench, services.simulator < services.doctor, services.cli < services.docs (bench and simulator are
peers; docs reads every command's parser). The load generator
imports nothing from services but services.common.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LAYERS: dict[str, int] = {
    "services.common": 0,
    "services.engine": 1,
    "services.predictor": 2,
    "services.gateway": 3,
    "services.bench": 4,
    "services.simulator": 4,
    "services.cli": 5,
    "services.doctor": 5,
    "services.docs": 6,
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


def violations() -> list[str]:
    found = []
    for path in sorted((ROOT / "services").rglob("*.py")) + sorted((ROOT / "loadgen").rglob("*.py")):
        if "_generated" in path.parts:
            continue
        importer = _module_name(path)
        own = _package(importer)
        for line, module in _imports(path):
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
