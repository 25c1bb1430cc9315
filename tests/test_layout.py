"""The package layout keeps its promises: imports point down the layers and never go round in a cycle.

Every ``import`` in every module counts, including those inside functions and under
``TYPE_CHECKING``: a lazy import is still a dependency a reader has to follow.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"trainbus.engine": ROOT / "engine", "trainbus.hooks": ROOT / "hooks", "trainbus.plugins": ROOT / "plugins"}

#: plugins/ subpackages from the bottom up: a feature subpackage may import features, never the facade
#: or the cli; the facade may import every feature; the cli sits on top of the facade.
FEATURES = (
    "distributed", "optimization", "data", "evaluation", "control", "checkpoints", "observability", "adapters",
    "averaging",
)  # fmt: skip
FACADE, CLI = "facade", "cli"


def module_files() -> dict[str, Path]:
    """``trainbus.x.y`` -> its file, for every module of the three packages."""
    modules = {}
    for package, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            parts = path.relative_to(folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join((package, *parts))] = path
    return modules


def imports_of(name: str, path: Path, known: Iterable[str]) -> set[str]:
    """The trainbus modules ``name`` imports, relative imports resolved, ``from pkg import module`` included."""
    known = set(known)
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            targets = [source] + [f"{source}.{alias.name}" for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = module_files()
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def find_cycle(graph: Mapping[str, Iterable[str]]) -> list[str] | None:
    """One import cycle as ``[a, b, ..., a]``, or None (depth-first search, three colours)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: finished
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in graph.get(node, ()):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def subpackage(module: str) -> str | None:
    """``trainbus.plugins.<sub>.x`` -> ``<sub>``; None for the plugins index and other packages."""
    parts = module.split(".")
    return parts[2] if len(parts) > 3 and parts[1] == "plugins" else None


def test_the_cycle_finder_finds_cycles() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_the_walker_resolves_relative_and_lazy_imports(tmp_path: Path) -> None:
    source = tmp_path / "m.py"
    source.write_text("from ..facade import trainer\ndef f():\n    from .tensors import x\n")
    known = {"trainbus.plugins.facade.trainer", "trainbus.plugins.evaluation.tensors", "trainbus.plugins.facade"}
    assert imports_of("trainbus.plugins.evaluation.collector", source, known) == {
        "trainbus.plugins.facade",
        "trainbus.plugins.facade.trainer",
        "trainbus.plugins.evaluation.tensors",
    }


def test_every_plugins_module_lives_in_a_known_subpackage() -> None:
    subs = {subpackage(m) for m in module_files()} - {None}
    assert subs == {*FEATURES, FACADE, CLI}


def test_no_module_import_cycle_in_plugins() -> None:
    # engine/ keeps two lazy, typing-only loops of its own (events <-> loop, events <-> filters)
    graph = {m: {t for t in ts if subpackage(t)} for m, ts in import_graph().items() if subpackage(m)}
    assert find_cycle(graph) is None


def test_no_subpackage_import_cycle() -> None:
    graph: dict[str, set[str]] = {}
    for module, targets in import_graph().items():
        if (sub := subpackage(module)) is not None:
            graph.setdefault(sub, set()).update(t for t in map(subpackage, targets) if t not in (None, sub))
    assert find_cycle(graph) is None


def reaches_above(layer: str, target: str) -> bool:
    """Whether importing ``target`` from ``layer`` points up the layers."""
    if layer == "engine":
        return target.startswith("trainbus.plugins")
    if layer == "hooks":
        return target.startswith(("trainbus.plugins", "trainbus.engine"))
    if target == "trainbus.plugins":  # the lazy index reaches everything, the facade included
        return layer != CLI
    return subpackage(target) in ({CLI} if layer == FACADE else {FACADE, CLI})


def test_reaches_above_knows_the_layers() -> None:
    assert reaches_above("control", "trainbus.plugins.facade.arguments")
    assert reaches_above("optimization", "trainbus.plugins")
    assert reaches_above("facade", "trainbus.plugins.cli.demo")
    assert not reaches_above("facade", "trainbus.plugins.control.flow")
    assert not reaches_above("evaluation", "trainbus.plugins.optimization.precision")


@pytest.mark.parametrize("layer", ["engine", "hooks", *FEATURES, FACADE])
def test_no_layer_imports_one_above_it(layer: str) -> None:
    offenders = [
        f"{module} imports {target}"
        for module, targets in import_graph().items()
        if module.split(".")[1] == layer or subpackage(module) == layer
        for target in targets
        if reaches_above(layer, target)
    ]
    assert not offenders


def test_the_top_level_package_imports_trainbus_lazily_only() -> None:
    """``trainbus/__init__.py`` (the folder trainbus_root) resolves names on first access: at module level
    it may import trainbus modules only for type checkers, so ``import trainbus.engine`` stays the engine."""
    tree = ast.parse((ROOT / "trainbus_root" / "__init__.py").read_text())
    eager = [
        ast.unparse(node)
        for node in tree.body
        if isinstance(node, ast.Import | ast.ImportFrom)
        and any(n.startswith("trainbus") for n in [getattr(node, "module", None) or "", *(a.name for a in node.names)])
    ]
    assert not eager
    lazy = [node for node in tree.body if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)]
    assert lazy, "the public names are imported under TYPE_CHECKING for type checkers"
