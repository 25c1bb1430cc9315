"""What a ``ResumeMismatch`` says to do: the attribute or state that differs, and the change that fixes it
(add it to ``state_dict()`` / ``load_state_dict()``, or declare it ``not_resumed`` / pass ``ignore_attributes``)."""

from __future__ import annotations

from typing import Any

Snapshot = dict[str, Any]


def name_of(path: str, snapshot: Snapshot) -> str:
    """``/attributes/P/field/...`` as ``P.field`` (saying when ``state_dict()`` leaves it out); others as they are."""
    parts = path.split("/")
    if len(parts) < 4 or parts[1] != "attributes":
        return path
    plugin, field = parts[2], parts[3].removesuffix(" (length)")
    rest = "/".join(parts[4:])
    saved = field in snapshot["plugins"].get(plugin, {})
    where = "" if saved else ", an attribute not in its state_dict()"
    return f"{path} (plugin attribute {plugin}.{field}{'/' + rest if rest else ''}{where})"


LENGTH_REMEDY = (
    "Something that decides when the run stops (a counter, a patience, a best value) is not restored: add it to "
    "its plugin's state_dict() and load_state_dict()"
)
DELIBERATE = (
    "if it differs after a resume on purpose (a start time, a path, a cache), list it in {cls}.not_resumed = "
    "({field!r},) or pass ignore_attributes=[{name!r}]"
)


def remedy(path: str, snapshot: Snapshot) -> str:
    """What to change, for the first difference at ``path``: which attribute, and how."""
    parts = path.split("/")
    section = parts[1] if len(parts) > 1 else ""
    if section == "attributes" and len(parts) > 3:
        plugin, field = parts[2], parts[3].removesuffix(" (length)")
        cls = snapshot.get("classes", {}).get(plugin, plugin)
        deliberate = DELIBERATE.format(cls=cls, field=field, name=f"{plugin}.{field}")
        if field in snapshot["plugins"].get(plugin, {}):
            return (f"{plugin}.state_dict() holds {field!r} but load_state_dict() does not set {plugin}.{field} back "
                    f"from it: restore it there; {deliberate}")  # fmt: skip
        return f"Add {field!r} to {plugin}.state_dict() and restore it in load_state_dict(); {deliberate}"
    if section == "plugins" and len(parts) > 2:
        key = "/".join(parts[3:]) or "its state"
        return (f"{parts[2]}.state_dict() gives another {key!r} after the resume: load_state_dict() must restore it, "
                "and whatever it is computed from must be in state_dict() too")  # fmt: skip
    if section == "state":
        return ("The engine restores State itself: a plugin writes this field from something it does not save (see "
                "the plugin attributes named here, if any): add that to the plugin's state_dict()")  # fmt: skip
    return (
        "The step's inputs differ after loading: a plugin changes the step (its loss, gradients, learning rate) "
        "from state its state_dict() leaves out (see the plugin attributes named here, if any): add it there, "
        "and draw random numbers only from the RNGs a checkpoint holds (python, numpy, torch)"
    )


__all__ = ["DELIBERATE", "LENGTH_REMEDY", "name_of", "remedy"]
