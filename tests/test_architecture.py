"""kiln's imports follow its layers (docs/architecture.md): each package imports only from its own
layer or the layers below it, no two packages import each other (directly or through others), and
kiln modules are imported at the top of a module, not inside functions. Read from the source with
`ast`: nothing is imported."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "kiln"

# Lowest first. A module may import from its own layer and any layer above it in this list.
LAYERS = [
    {"errors", "fsutil", "indexcheck", "steptrace"},
    {"hub", "tokenizer", "sampling", "messages"},
    {"weights"},
    {"cache", "models"},
    {"tune"},
    {"ops"},
    {"backends"},
    {"engine"},
    {"api"},
    {"server", "cli"},
    {"tools"},
]
RANK = {name: i for i, layer in enumerate(LAYERS) for name in layer}
MAX_LOCAL_IMPORTS = 14     # kiln modules imported inside functions (the budget: under 15)


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def kiln_imports(path: Path):
    """(imported kiln module, inside a function?) for each import statement of a kiln module."""
    tree = ast.parse(path.read_text())
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            target = ".".join(base + ([node.module] if node.module else []))
        elif isinstance(node, ast.Import):
            target = next((a.name for a in node.names if a.name.split(".")[0] == "kiln"), "")
        else:
            continue
        if target.split(".")[0] != "kiln":
            continue
        up, local = node, False
        while up in parents:
            up = parents[up]
            local = local or isinstance(up, (ast.FunctionDef, ast.AsyncFunctionDef))
        yield target, local


def package_of(module: str) -> str | None:
    """The top-level piece under kiln (kiln.ops.gdn.kernels -> ops); None for kiln itself."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def edges() -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for path in sorted(ROOT.rglob("*.py")):
        src = package_of(module_name(path))
        for target, _ in kiln_imports(path):
            dst = package_of(target)
            if src is not None and dst is not None and dst != src:
                out.setdefault(src, set()).add(dst)
    return out


def test_every_package_has_a_layer():
    pieces = {package_of(module_name(p)) for p in ROOT.rglob("*.py")} - {None}
    assert pieces <= RANK.keys(), f"place these in LAYERS (and docs/architecture.md): {sorted(pieces - RANK.keys())}"


def test_imports_follow_the_layers():
    wrong = sorted(f"kiln.{src} imports kiln.{dst}" for src, dsts in edges().items() for dst in dsts
                   if RANK.get(dst, -1) > RANK.get(src, len(LAYERS)))
    assert not wrong, "imports against the layer order:\n" + "\n".join(wrong)


def test_no_cycle_between_packages():
    graph = edges()

    def reaches(start: str, goal: str, seen: set) -> bool:
        for nxt in graph.get(start, ()):
            if nxt == goal or (nxt not in seen and (seen.add(nxt) or reaches(nxt, goal, seen))):
                return True
        return False

    cycles = sorted(f"kiln.{a} <-> kiln.{b}" for a in graph for b in graph[a] if reaches(b, a, set()))
    assert not cycles, "package cycles:\n" + "\n".join(cycles)


def test_kiln_modules_are_imported_at_the_top():
    local = [(module_name(p), target) for p in sorted(ROOT.rglob("*.py")) for target, inside in kiln_imports(p)
             if inside]
    assert len(local) <= MAX_LOCAL_IMPORTS, (
        f"{len(local)} function-local kiln imports (at most {MAX_LOCAL_IMPORTS}):\n"
        + "\n".join(f"{m}: {t}" for m, t in local))


@pytest.mark.parametrize("src,dst", [("models", "ops"), ("tune", "ops"), ("ops", "backends"), ("cli", "tools")])
def test_the_checker_catches_a_wrong_import(src, dst, tmp_path, monkeypatch):
    """A planted import against the order is reported (the checks above can fail)."""
    planted = ROOT / src / "_planted_import_check.py"
    planted.write_text(f"from kiln.{dst} import __name__ as _x  # noqa\n")
    try:
        with pytest.raises(AssertionError):
            test_imports_follow_the_layers()
    finally:
        planted.unlink()
