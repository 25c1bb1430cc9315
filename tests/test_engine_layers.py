"""The engine's core imports in one direction, and its testing kit sits above it (#28 item 11).

Every import counts, as in test_layout: a lazy one or one under ``TYPE_CHECKING`` is still a dependency a
reader has to follow. The core (bus, events, filters, payloads, ordering, lifecycle, assembly, loop,
passes, plugin, ...) must have no cycle: payload types and filters below the bus, the bus below the loop.
``trainbus.engine.testing`` imports the engine; no core module imports it, nor the package's own index.
"""

from __future__ import annotations

from collections.abc import Mapping

from test_layout import find_cycle, import_graph

PACKAGE = "trainbus.engine"
KIT = "trainbus.engine.testing"


def engine_graph() -> dict[str, set[str]]:
    """The engine's modules (its index left out) -> the engine modules they import."""
    return {
        module: {t for t in targets if t.startswith(PACKAGE + ".")}
        for module, targets in import_graph().items()
        if module.startswith(PACKAGE + ".")
    }


def core(graph: Mapping[str, set[str]]) -> dict[str, set[str]]:
    return {m: {t for t in ts if not t.startswith(KIT)} for m, ts in graph.items() if not m.startswith(KIT)}


def reaches(graph: Mapping[str, set[str]], start: str, goal: str) -> bool:
    seen, todo = set(), [start]
    while todo:
        node = todo.pop()
        if node == goal:
            return True
        if node not in seen:
            seen.add(node)
            todo.extend(graph.get(node, ()))
    return False


def test_the_core_has_no_import_cycle() -> None:
    assert find_cycle(core(engine_graph())) is None


def test_the_core_imports_neither_the_testing_kit_nor_the_package_index() -> None:
    modules = import_graph()
    for module, targets in modules.items():
        if module.startswith(PACKAGE + ".") and not module.startswith(KIT):
            assert not {t for t in targets if t.startswith(KIT)}, f"{module} imports the testing kit"
            assert PACKAGE not in targets, f"{module} imports trainbus.engine itself (its index imports every module)"


def test_payloads_and_filters_sit_below_the_bus_and_the_bus_below_the_loop() -> None:
    graph = core(engine_graph())
    below = {
        "payloads": ["events", "filters", "bus", "loop", "plugin"],
        "filters": ["events", "bus", "loop"],
        "events": ["bus", "loop", "plugin"],
        "ordering": ["bus", "loop"],
        "bus": ["loop", "plugin", "assembly", "lifecycle", "passes"],
        "plugin": ["loop", "assembly"],
        "lifecycle": ["loop"],
        "passes": ["loop"],
    }
    upward = [
        f"{low} -> {high}"
        for low, highs in below.items()
        for high in highs
        if reaches(graph, f"{PACKAGE}.{low}", f"{PACKAGE}.{high}")
    ]
    assert not upward, f"imports pointing up the engine's layers: {upward}"


def test_the_testing_kit_imports_the_engine() -> None:
    graph = engine_graph()
    assert any(t.startswith(PACKAGE + ".") and not t.startswith(KIT) for t in graph[f"{KIT}.kit"])


def test_the_engine_view_declares_every_public_attribute_of_the_engine() -> None:
    import torch

    from trainbus.engine import Engine
    from trainbus.engine.view import EngineView

    engine = Engine(torch.nn.Linear(1, 1))
    public = {n for n in {*dir(Engine), *vars(engine)} if not n.startswith("_")}
    declared = {n for n in {*vars(EngineView), *EngineView.__annotations__} if not n.startswith("_")}
    assert public - declared == set(), "add them to engine/view.py, so ev.engine.<name> type-checks"
    assert declared - public == set(), "engine/view.py declares what Engine lacks"
