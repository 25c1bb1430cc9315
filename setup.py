"""Build hook: an editable install (``pip install -e .``) that type checkers can read (#28 item 9).

setup.cfg maps one import namespace onto the repository's folders (``trainbus.engine = engine`` ...).
For such a layout setuptools' default editable mode installs an import hook (a ``MetaPathFinder`` in
``__editable___trainbus_*_finder.py``, run from a ``.pth`` line that starts with ``import``). Python
runs it; mypy and pyright never do: they only read the *path* lines of ``.pth`` files, so they reported
"Cannot find implementation or library stub for module named trainbus.engine" and typed payloads
checked nothing. (``editable_mode=compat`` puts the repository root on the path, where there is no
``trainbus`` folder; ``editable_mode=strict`` links every file, so a new module needs a reinstall.)

Here the editable wheel builds ``build/__editable__.trainbus-<version>.typed/trainbus/``: symlinks to
the files of ``trainbus_root/`` and to the ``engine/``, ``hooks/`` and ``plugins/`` folders, following
setup.cfg's ``package_dir``, and its ``.pth`` holds that folder's path. Python and mypy both find
``trainbus`` there (with its ``py.typed``), edits and new modules inside the mapped folders show at
once, and nothing else of the repository lands on ``sys.path``. A normal install (a wheel) is
unchanged: it copies the files. An explicit ``--config-settings editable_mode=strict|compat``, or a
system without symlinks, gets setuptools' own strategy.
"""

from __future__ import annotations

import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from setuptools import setup
from setuptools.command.editable_wheel import editable_wheel


class _PathFile:
    """An editable strategy (setuptools' ``EditableStrategy`` protocol): one ``.pth`` with a path line."""

    def __init__(self, name: str, folder: Path) -> None:
        self.name = name
        self.folder = folder

    def __call__(self, wheel: Any, files: list[str], mapping: Mapping[str, str]) -> None:
        wheel.writestr(f"__editable__.{self.name}.pth", f"{self.folder.resolve()}\n".encode())

    def __enter__(self) -> _PathFile:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


def link_tree(project: Path, package_dir: Mapping[str, str], folder: Path) -> Path:
    """``folder`` holding each mapped package as links: a package's own files, its mapped subpackages' folders."""
    shutil.rmtree(folder, ignore_errors=True)
    for package in sorted(package_dir, key=lambda name: name.count(".")):
        source = project / package_dir[package]
        target = folder.joinpath(*package.split("."))
        if package.count(".") == 0:
            target.mkdir(parents=True)
            for entry in source.iterdir():
                if entry.name != "__pycache__":
                    (target / entry.name).symlink_to(entry.resolve(), target_is_directory=entry.is_dir())
        else:  # a subpackage's folder, linked whole: new modules in it appear without a reinstall
            target.symlink_to(source.resolve(), target_is_directory=True)
    return folder


class typed_editable_wheel(editable_wheel):  # setuptools' command naming
    def _select_strategy(self, name: str, tag: str, build_lib: Any) -> Any:
        mode = str(getattr(self, "mode", None) or "").lower()
        package_dir = dict(self.distribution.package_dir or {})
        if mode in {"strict", "compat"} or "" in package_dir or not package_dir:
            return super()._select_strategy(name, tag, build_lib)
        project = Path(self.project_dir)
        try:
            folder = link_tree(project, package_dir, project / "build" / f"__editable__.{name}-{tag}.typed")
        except (OSError, NotImplementedError):  # no symlinks here: setuptools' import hook still runs
            return super()._select_strategy(name, tag, build_lib)
        return _PathFile(f"{name}-{tag}", folder)


setup(cmdclass={"editable_wheel": typed_editable_wheel})
