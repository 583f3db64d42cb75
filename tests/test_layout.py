"""The package's imports point down its layers (LAYERS); nothing of the library imports the command line's tools."""
from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "rawflash"
# A benchmark of its own (``rawflash bench --ring``): it takes the FLOP count from the IO model.
TOOLS_OUTSIDE_CLI = {"rawflash/distributed/bench.py"}


def _package(path: Path) -> list[str]:
    """The package ``path``'s module belongs to (a package's ``__init__`` belongs to the package itself)."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    package = parts if parts[-1] == "__init__" else parts[:-1]
    return [p for p in package if p != "__init__"]


def _from_module(node: ast.ImportFrom, package: list[str]) -> str:
    """The absolute name of the module a ``from ... import`` statement imports from."""
    base = package[:len(package) - node.level + 1] if node.level else []
    return ".".join(base + ([node.module] if node.module else []))


def _imports(path: Path) -> set[str]:
    """Every module ``path`` imports, relative imports resolved to absolute names."""
    package = _package(path)
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            module = _from_module(node, package)
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


def _module_name(path: Path) -> str:
    """``rawflash/kernels/forms.py`` is ``rawflash.kernels.forms``; ``rawflash/cli/__init__.py`` is ``rawflash.cli``."""
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _owner(name: str) -> str:
    """The package's module that ``name`` is or lives in: ``rawflash.numba_kernels.Twin`` is the package
    ``rawflash.numba_kernels`` (its ``__init__``), ``rawflash.__version__`` the package ``rawflash``."""
    while name not in MODULES:
        name = name.rpartition(".")[0]
    return name


def _dependencies(path: Path) -> set[str]:
    """The package's modules ``path`` imports, anywhere in the file (inside functions too): ``import a.b`` depends
    on ``a.b``; ``from a import b`` on the module ``a.b`` where there is one, else on ``a`` (``b`` is one of its
    names). So ``from .. import settings`` depends on ``rawflash.settings``, not on the package ``rawflash``."""
    package = _package(path)
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            module = _from_module(node, package)
            names |= {f"{module}.{a.name}" if f"{module}.{a.name}" in MODULES else module for a in node.names}
    return {_owner(n) for n in names if n == "rawflash" or n.startswith("rawflash.")}


# The package's layers, bottom to top: a module imports modules of its own layer or of the layers below, never one
# above. ``pkg.*`` is a folder (its ``__init__`` and every module in it); other names are single modules.
LAYERS = (
    # what a call is (problem), how arrays are told apart and moved (arrays), the settings, the float64
    # reference, the array-module helper and a call's signature: they import nothing of rawflash
    ("rawflash.settings", "rawflash.problem", "rawflash.arrays", "rawflash.reference", "rawflash._xp",
     "rawflash.signature"),
    ("rawflash.numba_kernels.*",),  # the Numba twins of the kernels
    ("rawflash.kernels.*",),        # forms, tiles, launch formulas, compiling and both backends
    ("rawflash.validation",),       # a call's arguments checked into a Problem, with the kernels' limits
    ("rawflash.api", "rawflash.fp8", "rawflash.combine"),  # the public functions
    # ring attention over the public functions; rawflash under JAX (XLA custom calls over the planned launches)
    ("rawflash.distributed.*", "rawflash.jax.*"),
    ("rawflash.cli.*", "rawflash", "rawflash.__main__"),  # the command line and the package's own namespace
)
# Imports that point up, each with its reason.
UPWARD = {
    # the ring's benchmark (``rawflash bench --ring``; a tool of the command line that runs beside the ring)
    ("rawflash.distributed.bench", "rawflash.cli.iomodel"): "it takes the FLOP count from the IO model "
                                                            "(TOOLS_OUTSIDE_CLI)",
    ("rawflash.distributed.bench", "rawflash"): "its single-GPU baseline times rawflash.forward / backward as a "
                                                "caller does",
}


def _layer(module: str) -> int:
    for i, layer in enumerate(LAYERS):
        for entry in layer:
            folder = entry.removesuffix(".*")
            if module == folder or (entry.endswith(".*") and module.startswith(folder + ".")):
                return i
    raise AssertionError(f"{module} is in no layer of LAYERS: place it there")


def test_the_resolver_sees_each_kind_of_import():
    assert "rawflash.settings" in _dependencies(PACKAGE / "kernels" / "compile.py")  # from .. import settings
    assert "rawflash" not in _dependencies(PACKAGE / "kernels" / "compile.py")
    assert "rawflash.numba_kernels" in _dependencies(PACKAGE / "kernels" / "numba_backend.py")  # ... import Twin
    assert "rawflash.kernels.cupy_backend" in _dependencies(PACKAGE / "fp8.py")  # inside a function
    assert "rawflash" in _dependencies(PACKAGE / "cli" / "sysinfo.py")  # from .. import __version__


def test_every_import_points_down():
    """No module of the package imports one of a layer above its own (LAYERS), but for the reasons in UPWARD."""
    assert {m.rpartition(".")[0] for m in MODULES} >= {"rawflash.kernels", "rawflash.cli", "rawflash.numba_kernels"}
    wrong = []
    for module, path in MODULES.items():
        for dep in sorted(_dependencies(path)):
            if _layer(dep) > _layer(module) and (module, dep) not in UPWARD:
                wrong.append(f"{module} (layer {_layer(module)}) imports {dep} (layer {_layer(dep)})")
    assert not wrong, "imports that point up:\n" + "\n".join(wrong)
    for module, dep in UPWARD:
        assert dep in _dependencies(MODULES[module]), f"UPWARD lists {module} -> {dep}, which it no longer imports"


def test_problem_and_arrays_import_nothing_of_rawflash():
    """What a call is and what its arrays are sit at the bottom: validation, the kernels and the API build on them."""
    for module in ("rawflash.problem", "rawflash.arrays"):
        assert not _dependencies(MODULES[module]) - {module}, module


def test_problem_is_imported_from_its_own_module():
    """``Problem`` is ``rawflash.problem``'s: no code reaches it through a module that only imports it (the kernels'
    ``launch``, ``forms``, the backends, ``validation``), in imports or in code run from strings."""
    wrong = []
    for path in sorted([*PACKAGE.rglob("*.py"), *(ROOT / "tests").glob("*.py"), *(ROOT / "tools").glob("*.py")]):
        name = path.relative_to(ROOT).as_posix()
        text = path.read_text()
        for node in ast.walk(ast.parse(text)):
            if (isinstance(node, ast.ImportFrom) and any(a.name == "Problem" for a in node.names)
                    and _from_module(node, _package(path)) != "rawflash.problem"):
                wrong.append(f"{name}:{node.lineno}: Problem from {_from_module(node, _package(path))}")
        for match in re.finditer(r"(\w+)\.Problem\b", text):
            if match.group(1) != "problem":
                wrong.append(f"{name}:{text.count(chr(10), 0, match.start()) + 1}: {match.group(0)}")
        for match in re.finditer(r"from (rawflash[\w.]*) import ([\w, ]+)", text):  # strings of code too
            if "Problem" in match.group(2).replace(" ", "").split(",") and match.group(1) != "rawflash.problem":
                wrong.append(f"{name}:{text.count(chr(10), 0, match.start()) + 1}: {match.group(0)}")
    assert not wrong, "Problem taken from elsewhere than rawflash.problem:\n" + "\n".join(sorted(set(wrong)))
