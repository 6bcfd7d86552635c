"""The project's import graph has no cycles, and ``model/`` stays free of the CPU backend and of I/O.

Every import counts: at module level and inside functions (a deferred import only hides a cycle),
and importing ``a.b`` imports the package ``a`` first (its ``__init__``), as Python does.
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("backends", "bench", "checkpoints", "cli", "model", "runner", "server", "tokenization", "train")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_modules() -> dict[str, Path]:
    modules = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            modules[module_name(path)] = path
    modules["run"] = ROOT / "run.py"
    return modules


def imports_of(name: str, path: Path, modules) -> set[str]:
    """The project modules ``name`` imports, each with the packages above it."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        targets = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package this module is in
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([node.module] if node.module else []))
            # ``from a import b``: the module a.b if there is one (a only as its package), else a's names
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        own_packages = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)}
        for target in targets:
            parts = target.split(".")
            named = [".".join(parts[:i]) for i in range(1, len(parts) + 1) if ".".join(parts[:i]) in modules]
            for i, candidate in enumerate(named):  # a.b.c imports a, a.b, a.b.c
                implicit = i < len(named) - 1  # a package above the one named: already importing if it is ours
                if candidate != name and not (implicit and candidate in own_packages):
                    found.add(candidate)
    return found


def graph():
    modules = project_modules()
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def find_cycle(edges) -> list[str] | None:
    """One cycle of the directed graph ``edges``, as a list of modules, or None."""
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = "done"
        return None

    for node in sorted(edges):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_the_cycle_finder_finds_a_cycle_through_a_package():
    assert find_cycle({"a.x": {"b"}, "b": {"b.y"}, "b.y": {"a"}, "a": set()}) is None
    assert find_cycle({"a.x": {"b"}, "b": {"b.y"}, "b.y": {"a.x"}}) == ["a.x", "b", "b.y", "a.x"]


def test_the_project_has_no_import_cycles():
    edges = graph()
    assert len(edges) > 40 and "model.layers" in edges and "model.partitioning" in edges["model.layers"]
    cycle = find_cycle(edges)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_model_imports_no_cpu_backend_and_does_no_io():
    edges = graph()
    for name, imported in edges.items():
        if name == "model" or name.startswith("model."):
            assert not {m for m in imported if m.split(".")[0] == "backends"}, (name, imported)  # takes it as an argument
            assert not {m for m in imported if m.split(".")[0] in ("runner", "checkpoints", "server", "bench")}, name
    for path in (ROOT / "model").rglob("*.py"):
        tree = ast.parse(path.read_text())
        used = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
        used |= {node.module.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
        assert not used & {"subprocess", "ctypes", "shutil", "tempfile", "pathlib", "os"}, (path.name, used)
        calls = {node.func.id for node in ast.walk(tree) if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)}
        assert "open" not in calls, path.name
