"""The shape of the code, checked from the source: no import cycles, and a loop that never asks which engine it has."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "vlmfast"
ENGINE_NAMES = {"single", "ddp", "fsdp", "deepspeed", "torch"}
ENGINE_CLASSES = {"Engine", "SingleEngine", "DDPEngine", "FSDPEngine", "DeepSpeedEngine", "DistributedDataParallel"}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """Every import of a vlmfast module by another, at any depth of the file (function-level and TYPE_CHECKING
    imports included: a cycle hidden in a function is still a cycle)."""
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                # `from vlmfast.x import y`: y may be a submodule (vlmfast.x.y) or a name in vlmfast.x
                targets = [f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in modules else node.module
                           for alias in node.names]
            graph[name] |= {t for t in targets if t in modules and t != name}
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return cycles


def test_the_package_has_no_import_cycles():
    cycles = find_cycles(import_graph())
    assert not cycles, "import cycles (break them with an argument or a shared module):\n" + "\n".join(
        " <-> ".join(c) for c in cycles)


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def engine_branches(path: Path) -> list[str]:
    """Places in `path` that branch on which engine runs: isinstance with an engine class, comparisons with an
    engine's name, `spec.engine` / `engine.name` read at all."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("isinstance", "type"):
            names = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)} | {
                n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)}
            if names & ENGINE_CLASSES:
                found.append(f"line {node.lineno}: isinstance/type with an engine class")
        if isinstance(node, ast.Attribute) and node.attr in ("engine", "name", "backend") and isinstance(
                node.value, (ast.Attribute, ast.Name)):
            owner = node.value.attr if isinstance(node.value, ast.Attribute) else node.value.id
            if (owner, node.attr) in {("spec", "engine"), ("engine", "name"), ("spec", "backend"),
                                      ("backend", "name")}:
                found.append(f"line {node.lineno}: reads {owner}.{node.attr}")
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in ENGINE_NAMES:
            found.append(f"line {node.lineno}: the string {node.value!r}")
    return found


def test_the_loop_and_the_checkpoint_glue_never_ask_which_engine_runs():
    for relative in ("train/loop.py", "train/save_resume.py", "train/state.py", "train/evaluation.py"):
        assert not engine_branches(PACKAGE / relative), (relative, engine_branches(PACKAGE / relative))


def test_only_engines_the_spec_and_the_estimator_ask_which_engine_runs():
    """Everything else asks a capability (``engine_traits(spec, world_size)``, ``engine.shards_parameters``, ...)."""
    allowed = ("engines/", "spec.py", "memory/")  # the spec validates it; the estimator models engines before any runs
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE).as_posix()
        if relative.startswith(allowed):
            continue
        branches = [b for b in engine_branches(path) if "the string" not in b and "backend" not in b]
        assert not branches, (relative, branches)


def test_the_engine_check_catches_a_branch(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def f(self):\n    if self.engine.name == 'deepspeed':\n        pass\n"
                   "    if isinstance(self.model, DistributedDataParallel):\n        pass\n")
    assert len(engine_branches(bad)) == 3


def test_strategies_never_import_each_other():
    graph = import_graph()
    shared = {"vlmfast.strategies.base", "vlmfast.strategies.registry"}
    for name, targets in graph.items():
        if name.startswith("vlmfast.strategies.") and name not in shared:
            others = {t for t in targets if t.startswith("vlmfast.strategies.") and t not in shared}
            assert not others, f"{name} imports {sorted(others)}: move the shared helper to a shared module"
