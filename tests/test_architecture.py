"""The package map holds: no import cycles inside the project, and ddtree/ never imports the training stack.

Imports are read from the source (ast), including those inside functions: a lazy import that
closes a cycle is still a cycle, only hidden until run time.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("ddtree", "training", "data")


def module_name(path: Path) -> str:
    return ".".join(path.relative_to(REPO).with_suffix("").parts)


def project_imports(path: Path) -> set[str]:
    """Project modules imported anywhere in the file (absolute or relative, at any depth).

    Imports under `if TYPE_CHECKING:` are left out: they never run, they only name types.
    """
    package = module_name(path).rsplit(".", 1)[0]
    tree = ast.parse(path.read_text())
    type_only = {id(n) for block in ast.walk(tree) if isinstance(block, ast.If) and "TYPE_CHECKING" in ast.unparse(block.test)
                 for n in ast.walk(block)}
    found = set()
    for node in ast.walk(tree):
        if id(node) in type_only:
            continue
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            names = [base] + [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        found.update(name for name in names if name.split(".")[0] in PACKAGES)
    return found


def import_graph() -> dict[str, set[str]]:
    files = [p for package in PACKAGES for p in (REPO / package).glob("*.py")]
    modules = {module_name(p): p for p in files}
    return {name: {m for m in project_imports(path) if m in modules and m != name} for name, path in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for child in sorted(graph[node]):
            if state.get(child) == 1:
                return path[path.index(child):] + [child] if child in path else [node, child]
            if child not in state:
                cycle = visit(child, path + [child])
                if cycle:
                    return cycle
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state:
            cycle = visit(start, [start])
            if cycle:
                return cycle
    return None


def test_the_import_graph_has_no_cycle():
    graph = import_graph()
    assert "training.module" in graph and "training.data" in graph  # the graph was really read
    assert find_cycle(graph) is None, f"import cycle: {' -> '.join(find_cycle(graph))}"


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_ddtree_imports_no_training_framework():
    banned = ("training", "lightning", "deepspeed", "datasets", "peft")
    for path in (REPO / "ddtree").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                bad = [n for n in names if n.split(".")[0] in banned and not getattr(node, "level", 0)]
                assert not bad, f"{path.name} imports {bad}: ddtree/ is the library, it must not need the training stack"
