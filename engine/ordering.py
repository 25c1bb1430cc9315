"""Handler order: the phases (``Priority``), ``before`` / ``after`` declarations, and the sort.

A handler runs in a phase, one of the ``Priority`` constants (FIRST, PRODUCER, DEFAULT, CONSUMER,
LAST: earlier phases run first), and may say which handlers of its event it runs ``before`` or
``after``. A handler may also declare what it reads and writes on the payload (``reads="metrics"``,
``writes="metrics"``, or one key, ``"metrics.eval_loss"``): every writer of a field runs before every
other handler that reads it, whatever order the plugins were listed in, so the order follows the data.
``ordered`` turns the registrations of one event into their call order: phases first to last, inside
a phase a topological order of the constraints that picks the earliest registered of the ready
handlers. A constraint that cannot hold (a cycle, a reader in an earlier phase than its writer) is a
ConfigError naming both handlers. The bus (``bus.py``) calls it on registration and removal, never
per event.
"""

from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NoReturn

from .errors import ConfigError, suggest
from .events import EventType
from .filters import EventFilter

#: what ``before=`` / ``after=`` take: a handler or plugin name, ``"*"``, or a sequence of them
Targets = str | Sequence[str]
#: ``before="*"`` / ``after="*"``: every other handler of the same phase
EVERY = "*"


#: names a ``before=`` / ``after=`` may use although nothing of that name is attached (see
#: ``register_order_names``); plugin classes defined in the process count without registering
REGISTERED_NAMES: set[str] = set()


def register_order_names(*names: str) -> None:
    """Declare plugin names that order declarations may name before their class is imported.

    fit() refuses a ``before=`` / ``after=`` naming nothing that ever attaches (a typo). A plugin that
    names an optional peer (EMA runs before ``"HalfPrecisionEval"`` when both are attached) is fine
    when the peer's class exists; a package that imports its plugins lazily registers their names here.
    """
    REGISTERED_NAMES.update(names)


def target_names(targets: Targets, what: str) -> tuple[str, ...]:
    """``before=`` / ``after=`` as a tuple of names, checked."""
    names = (targets,) if isinstance(targets, str) else tuple(targets)
    for target in names:
        if not isinstance(target, str) or not target:
            raise ConfigError(f"{what}= takes handler or plugin names (or '*'), got {targets!r}")
    return names


def field_names(targets: Targets, what: str, event: EventType[Any]) -> tuple[str, ...]:
    """``reads=`` / ``writes=`` as a tuple of payload fields (``"metrics"``, ``"metrics.eval_loss"``), checked
    against ``event``'s payload class."""
    names = (targets,) if isinstance(targets, str) else tuple(targets)
    payload = event.payload_type
    fields = [f.name for f in dataclasses.fields(payload)] if dataclasses.is_dataclass(payload) else []
    allowed = [f for f in fields if f != "engine"]
    for target in names:
        field = target.partition(".")[0] if isinstance(target, str) else None
        if field not in allowed:
            raise ConfigError(
                f"{what}={targets!r} at event {event.name}: {target!r} is no field of its payload "
                f"{event.payload_type.__name__}{suggest(str(field), allowed)}; fields: {allowed} (a key inside one: "
                f"'{allowed[0] if allowed else 'field'}.key')"
            )
    return names


class Order:
    """A phase with the handlers to run before and after inside it; made by ``Priority.X.before(...)``.

    What a ``priority=`` argument or a plugin's ``priority`` class attribute may hold besides a
    bare phase, so one declaration carries both, e.g. ``priority = Priority.CONSUMER.after("Checkpointing")``.

    Example:
        >>> order = Priority.FIRST.before("HalfPrecisionEval").after("ScheduleFreeModes")
        >>> order.phase, order.precedes, order.follows
        (1000, ('HalfPrecisionEval',), ('ScheduleFreeModes',))
    """

    __slots__ = ("follows", "phase", "precedes")

    def __init__(self, phase: int, precedes: Targets = (), follows: Targets = ()) -> None:
        if isinstance(phase, bool) or not isinstance(phase, int):
            raise ConfigError(f"priority must be a phase (an int, see Priority), got {phase!r}")
        self.phase = int(phase)
        self.precedes = target_names(precedes, "before")
        self.follows = target_names(follows, "after")

    def before(self, *targets: str) -> Order:
        """This order, also running before ``targets`` (handler or plugin names, or ``"*"``)."""
        return Order(self.phase, self.precedes + target_names(targets, "before"), self.follows)

    def after(self, *targets: str) -> Order:
        """This order, also running after ``targets`` (handler or plugin names, or ``"*"``)."""
        return Order(self.phase, self.precedes, self.follows + target_names(targets, "after"))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Order):
            return NotImplemented
        return (self.phase, self.precedes, self.follows) == (other.phase, other.precedes, other.follows)

    def __hash__(self) -> int:
        return hash((self.phase, self.precedes, self.follows))

    def __repr__(self) -> str:
        text = phase_name(self.phase)
        for method, names in (("before", self.precedes), ("after", self.follows)):
            if names:
                text += f".{method}({', '.join(map(repr, names))})"
        return text


class Phase(int):
    """A named phase: an int (higher runs first) that can also say ``.before(...)`` / ``.after(...)``."""

    label: str

    def __new__(cls, value: int, label: str) -> Phase:
        phase = super().__new__(cls, value)
        phase.label = label
        return phase

    def __getnewargs__(self) -> tuple[int, str]:  # type: ignore[override]  # copy and pickle keep the label
        return int(self), self.label

    def before(self, *targets: str) -> Order:
        """Run in this phase, before ``targets`` (handler or plugin names, or ``"*"``)."""
        return Order(self).before(*targets)

    def after(self, *targets: str) -> Order:
        """Run in this phase, after ``targets`` (handler or plugin names, or ``"*"``)."""
        return Order(self).after(*targets)

    def __repr__(self) -> str:
        return f"Priority.{self.label}"


class Priority:
    """The phases, in the order they run. Producers fill a payload before consumers read it.

    Inside a phase, say the order with ``before=`` / ``after=`` (or ``Priority.X.before(...)``);
    an int between the phases still works but names nothing, so the built-in plugins use none.
    """

    FIRST = Phase(1000, "FIRST")  # state keepers that others read (e.g. AMP unscale before clipping)
    PRODUCER = Phase(100, "PRODUCER")  # handlers that add to a payload (loss/lr into logs, metrics into eval results)
    DEFAULT = Phase(0, "DEFAULT")
    CONSUMER = Phase(-100, "CONSUMER")  # handlers that read a finished payload (sinks, early stopping, checkpoint)
    LAST = Phase(-1000, "LAST")


_PHASES = {int(p): p.label for p in vars(Priority).values() if isinstance(p, Phase)}


def phase_name(priority: int) -> str:
    """``Priority.CONSUMER`` for -100, the number for a priority that is no named phase."""
    return f"Priority.{_PHASES[priority]}" if priority in _PHASES else str(priority)


class Registration:
    """One handler registered on one event: what the bus keeps, and what ``ordered`` sorts."""

    __slots__ = ("after", "before", "cleanup", "event", "filter", "fn", "name", "priority", "reads", "seq", "writes")

    def __init__(
        self,
        event: EventType[Any],
        fn: Callable[[Any], None],
        flt: EventFilter | None,
        priority: int,
        name: str,
        seq: int,
        cleanup: bool = False,
        before: tuple[str, ...] = (),
        after: tuple[str, ...] = (),
        reads: tuple[str, ...] = (),
        writes: tuple[str, ...] = (),
    ) -> None:
        self.event = event
        self.fn = fn
        self.filter = flt
        self.priority = priority
        self.name = name
        self.seq = seq
        self.cleanup = cleanup
        self.before = before
        self.after = after
        self.reads = reads
        self.writes = writes

    def names(self, target: str) -> bool:
        """Whether ``target`` (a handler name, or a plugin name for its ``<plugin>.<method>`` handlers) is this."""
        name = self.name
        return name == target or (name.startswith(target) and name[len(target) : len(target) + 1] == ".")


def ordered(records: Iterable[Registration]) -> tuple[Registration, ...]:
    """``records`` in the order they run: phases first to last, inside a phase a topological order
    of the before / after constraints that picks the earliest registered of the ready handlers.

    Runs on registration and removal only (the callers it feeds are rebuilt then), never per event.
    Raises ConfigError when a constraint cannot hold: a cycle, or a handler asked to run before one
    of an earlier phase (or after one of a later phase).
    """
    by_seq = sorted(records, key=lambda r: r.seq)
    if not any(r.before or r.after or r.writes for r in by_seq):
        return tuple(sorted(by_seq, key=lambda r: -r.priority))  # stable: registration order in a phase
    edges: dict[Registration, dict[Registration, str]] = {r: {} for r in by_seq}  # first -> then -> why
    _add_data_edges(edges, by_seq)
    wild: list[tuple[Registration, Registration, str]] = []
    for record in by_seq:
        for direction, targets in (("before", record.before), ("after", record.after)):
            for target in targets:
                why = f"{record.name!r} says {direction}={target!r}"
                for other in by_seq:
                    if other is record:
                        continue
                    first, then = (record, other) if direction == "before" else (other, record)
                    if target == EVERY:
                        if other.priority == record.priority and EVERY not in getattr(other, direction):
                            wild.append((first, then, why))
                    elif other.names(target):
                        _add_edge(edges, first, then, why)
    for first, then, why in wild:  # "*" yields to an explicit constraint between the same two handlers
        if first not in edges[then]:
            edges[first].setdefault(then, why)
    waiting = {r: 0 for r in by_seq}
    for first in by_seq:
        for then in edges[first]:
            waiting[then] += 1
    result: list[Registration] = []
    for phase in sorted({r.priority for r in by_seq}, reverse=True):
        members = [r for r in by_seq if r.priority == phase]
        ready = [(r.seq, r) for r in members if not waiting[r]]
        heapq.heapify(ready)
        placed = 0
        while ready:
            _, record = heapq.heappop(ready)
            result.append(record)
            placed += 1
            for then in edges[record]:
                waiting[then] -= 1
                if not waiting[then]:
                    heapq.heappush(ready, (then.seq, then))
        if placed < len(members):
            _raise_cycle(edges, [r for r in members if waiting[r]])
    return tuple(result)


def _add_edge(
    edges: dict[Registration, dict[Registration, str]], first: Registration, then: Registration, why: str
) -> None:
    if first.priority > then.priority:
        return  # an earlier phase: holds already
    if first.priority < then.priority:
        raise ConfigError(
            f"handler order at {first.event.name} cannot hold: {why}, but {first.name!r} runs in "
            f"{phase_name(first.priority)}, after {then.name!r} in {phase_name(then.priority)}; "
            "move one of them to another phase or drop the constraint"
        )
    edges[first].setdefault(then, why)


def overlaps(written: str, read: str) -> bool:
    """Whether writing ``written`` can change what reading ``read`` sees: the same field, or one inside
    the other (``"metrics"`` and ``"metrics.eval_loss"``); two different keys of one field do not."""
    return written == read or written.startswith(read + ".") or read.startswith(written + ".")


def _add_data_edges(edges: dict[Registration, dict[Registration, str]], records: list[Registration]) -> None:
    """A handler that writes a payload field runs before every other handler that reads it (``reads=`` /
    ``writes=``), whatever the registration order; a reader in an earlier phase than the writer raises."""
    writers = [r for r in records if r.writes]
    if not writers:
        return
    for reader in (r for r in records if r.reads):
        for writer in writers:
            if writer is reader:
                continue
            shared = next((f"{w}" for w in writer.writes for x in reader.reads if overlaps(w, x)), None)
            if shared is not None:
                _add_edge(edges, writer, reader, f"{writer.name!r} writes {shared!r}, which {reader.name!r} reads")


def _raise_cycle(edges: dict[Registration, dict[Registration, str]], stuck: list[Registration]) -> NoReturn:
    """Raise ConfigError naming one cycle among ``stuck`` (handlers that never became ready)."""
    inside = set(stuck)
    path = [stuck[0]]
    seen = {stuck[0]: 0}
    while True:  # every stuck handler waits on a stuck one: walking back must close a loop
        previous = next(r for r in stuck if path[-1] in edges[r] and r in inside)
        if previous in seen:
            cycle = path[seen[previous] :][::-1]
            break
        seen[previous] = len(path)
        path.append(previous)
    steps = [f"{a.name!r} before {b.name!r} ({edges[a][b]})" for a, b in zip(cycle, cycle[1:] + cycle[:1])]
    raise ConfigError(f"handler order at {cycle[0].event.name} has a cycle: " + "; ".join(steps))
