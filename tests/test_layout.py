"""The folders' dependencies point one way: nothing of the library imports the command line's tools."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "rawflash"
# A benchmark of its own (``rawflash bench --ring``): it takes the FLOP count from the IO model.
TOOLS_OUTSIDE_CLI = {"rawflash/distributed/bench.py"}


def _imports(path: Path) -> set[str]:
    """Every module ``path`` imports, relative imports resolved to absolute names."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    package = parts if parts[-1] == "__init__" else parts[:-1]
    package = [p for p in package if p != "__init__"]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            found |= {module} | {f"{module}.{a.name}" for a in node.names}
    return found


def test_only_the_cli_imports_the_cli():
    paths = sorted(PACKAGE.rglob("*.py"))
    assert any(p.parent.name == "kernels" for p in paths) and any(p.parent.name == "cli" for p in paths)
    assert "rawflash.cli.iomodel" in _imports(PACKAGE / "distributed" / "bench.py")  # the resolver sees `..cli`
    for path in paths:
        name = path.relative_to(ROOT).as_posix()
        if name.startswith("rawflash/cli/") or name in TOOLS_OUTSIDE_CLI or name == "rawflash/__main__.py":
            continue
        wrong = sorted(m for m in _imports(path) if m == "rawflash.cli" or m.startswith("rawflash.cli."))
        assert not wrong, f"{name} imports {wrong}: the library must not depend on the command line's tools"


def test_the_kernels_folder_does_not_import_the_api():
    for path in sorted((PACKAGE / "kernels").glob("*.py")):
        wrong = sorted(m for m in _imports(path) if m in ("rawflash.api", "rawflash.distributed")
                       or m.startswith("rawflash.distributed."))
        assert not wrong, f"{path.relative_to(ROOT)} imports {wrong}"
