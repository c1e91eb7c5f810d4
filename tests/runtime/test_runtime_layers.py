"""The runtime's layers, read from its source: model <- engine <- server. The server knows the engine only
through its typed seam (engine/api.py): it imports nothing from model/, and never probes the engine with
getattr/hasattr; the engine never imports the server."""

from __future__ import annotations

import ast
from pathlib import Path

import ddtree_runtime

PACKAGE = Path(ddtree_runtime.__file__).parent


def _imports(path: Path) -> set[str]:
    """Every module a file imports, at its top or inside a function, relative imports made absolute."""
    package = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts[:-1])
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                found.add(f"{base}.{node.module}" if node.module else base)
            else:
                found.add(node.module or "")
    return found


def _probes_of_the_engine(path: Path) -> list[int]:
    """Lines that call getattr/hasattr on something named like the engine."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr"):
            if "engine" in ast.unparse(node.args[0]):
                lines.append(node.lineno)
    return lines


def test_the_server_knows_the_engine_only_through_its_seam():
    server = sorted((PACKAGE / "server").glob("*.py"))
    assert len(server) > 10
    for path in server:
        model = sorted(m for m in _imports(path) if m.startswith("ddtree_runtime.model"))
        assert not model, f"{path.name} imports {model}"
        assert not _probes_of_the_engine(path), f"{path.name}: getattr/hasattr on the engine, lines " \
                                                 f"{_probes_of_the_engine(path)}"


def test_the_engine_never_imports_the_server():
    for path in sorted((PACKAGE / "engine").glob("*.py")):
        server = sorted(m for m in _imports(path) if m.startswith("ddtree_runtime.server"))
        assert not server, f"{path.name} imports {server}"
