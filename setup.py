"""Build hook: an editable install (``pip install -e .``) that type checkers can read (#28 item 9, #37 item 7).

setup.cfg maps one import namespace onto the repository's folders (``trainbus.engine = engine`` ...).
For such a layout setuptools' default editable mode installs an import hook (a ``MetaPathFinder`` in
``__editable___trainbus_*_finder.py``, run from a ``.pth`` line that starts with ``import``). Python
runs it; mypy and pyright never do: they only read the *path* lines of ``.pth`` files, so they reported
"Cannot find implementation or library stub for module named trainbus.engine" and typed payloads
checked nothing. (``editable_mode=compat`` puts the repository root on the path, where there is no
``trainbus`` folder; ``editable_mode=strict`` links every file, so a new module needs a reinstall.)

Here the editable wheel installs two files into site-packages:

- ``__editable___trainbus_<version>_typed.py`` (the ``RUNTIME`` text below, with the project's folder and
  setup.cfg's ``package_dir``): it keeps ``build/__editable__.trainbus-<version>-<tag>.typed/trainbus/``
  up to date: symlinks to each file of ``trainbus_root/`` and to the ``engine/``, ``hooks/`` and
  ``plugins/`` folders;
- ``__editable__.trainbus-<version>-<tag>.pth``: an ``import`` line that runs that module's ``ensure()``,
  then the link folder's path.

Python runs the ``import`` line at every start of the environment, before it reads the path line, so a
link folder deleted by ``rm -rf build`` or ``git clean -xdf`` is rebuilt, and a module new in
``trainbus_root/`` is linked, before anything imports ``trainbus`` (new modules in the folders linked
whole show without that). ``python -m mypy`` starts that same Python, so mypy finds ``trainbus`` (with
its ``py.typed``) on the path line; nothing else of the repository lands on ``sys.path``. Where the
folder cannot be written (a read-only checkout) ``ensure()`` installs an import hook mapping the same
folders, so Python still imports ``trainbus``. The folder is rebuilt under a temporary name and renamed
into place, and links are replaced by rename, so processes starting together never see half a folder.

A normal install (a wheel) is unchanged: it copies the files. An explicit ``--config-settings
editable_mode=strict|compat``, or a system without symlinks, gets setuptools' own strategy.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from setuptools import setup
from setuptools.command.editable_wheel import editable_wheel

#: the module written into site-packages; PROJECT, PACKAGE_DIR and FOLDER are prepended at build time.
#: Only ``os`` and ``sys`` at import: it runs at every interpreter start of the environment.
RUNTIME = '''
import os
import sys


def _want(project, package_dir):
    """{link path relative to FOLDER: what it links to}, and the real folders (the top-level packages)."""
    links, folders = {}, []
    for package in sorted(package_dir, key=lambda name: name.count(".")):
        source = os.path.join(project, package_dir[package])
        target = os.path.join(*package.split("."))
        if package.count(".") == 0:
            folders.append(target)
            for entry in os.listdir(source):
                if entry != "__pycache__" and package + "." + entry not in package_dir:
                    links[os.path.join(target, entry)] = os.path.join(source, entry)
        else:  # a subpackage's folder, linked whole: new modules in it appear at once
            links[target] = source
    return links, folders


def _link(source, path):
    """``path`` -> ``source``, replaced atomically where it already is something else."""
    try:
        if os.readlink(path) == source:
            return
    except OSError:
        pass
    spare = "%s.tmp-%d" % (path, os.getpid())
    if os.path.lexists(spare):
        os.unlink(spare)
    os.symlink(source, spare, target_is_directory=os.path.isdir(source))
    os.replace(spare, path)


def sync(project, package_dir, folder):
    """Make ``folder`` hold exactly the links setup.cfg's mapping asks for; returns ``folder``."""
    project = os.path.realpath(project)
    links, folders = _want(project, package_dir)
    if not os.path.isdir(folder):
        import shutil

        os.makedirs(os.path.dirname(folder), exist_ok=True)
        fresh = "%s.tmp-%d" % (folder, os.getpid())
        shutil.rmtree(fresh, ignore_errors=True)
        _fill(fresh, links, folders)
        try:
            os.rename(fresh, folder)
        except OSError:  # another process built it first
            shutil.rmtree(fresh, ignore_errors=True)
    _fill(folder, links, folders)
    return folder


def _fill(folder, links, folders):
    for sub in folders:
        os.makedirs(os.path.join(folder, sub), exist_ok=True)
        for entry in os.listdir(os.path.join(folder, sub)):  # a module deleted from the repository
            path = os.path.join(folder, sub, entry)
            if ".tmp-" in entry:  # another process's link about to be renamed into place (or a killed one's)
                continue
            if os.path.relpath(path, folder) not in links and os.path.islink(path):
                try:
                    os.unlink(path)
                except FileNotFoundError:
                    pass
    for relative, source in links.items():
        _link(source, os.path.join(folder, relative))


class _Finder:
    """The fallback where the link folder cannot be written: each mapped package from its own folder."""

    @classmethod
    def find_spec(cls, fullname, path=None, target=None):
        if fullname not in PACKAGE_DIR:
            return None
        from importlib.util import spec_from_file_location

        source = os.path.join(PROJECT, PACKAGE_DIR[fullname])
        init = os.path.join(source, "__init__.py")
        return spec_from_file_location(fullname, init, submodule_search_locations=[source])


def ensure():
    """Called by the ``.pth`` line at interpreter start: never raises (a failing line would print a traceback)."""
    if not os.path.isdir(PROJECT):  # the checkout moved or was deleted: nothing to link
        return
    try:
        sync(PROJECT, PACKAGE_DIR, FOLDER)
    except OSError:
        if _Finder not in sys.meta_path:
            sys.meta_path.insert(0, _Finder)
'''


def runtime_namespace(project: Path, package_dir: Mapping[str, str], folder: Path) -> dict[str, Any]:
    """RUNTIME's functions with its constants, as the installed module has them."""
    namespace: dict[str, Any] = {"PROJECT": str(project.resolve()), "PACKAGE_DIR": dict(package_dir),
                                 "FOLDER": str(folder.resolve())}  # fmt: skip
    exec(RUNTIME, namespace)
    return namespace


class _LinkedFolder:
    """An editable strategy (setuptools' ``EditableStrategy`` protocol): the module and the ``.pth`` above."""

    def __init__(self, name: str, tag: str, namespace: Mapping[str, Any]) -> None:
        self.name = f"{name}-{tag}"
        self.module = "__editable___" + re.sub(r"\W", "_", name) + "_typed"
        self.namespace = namespace

    def __call__(self, wheel: Any, files: list[str], mapping: Mapping[str, str]) -> None:
        module = self.module
        constants = "".join(f"{key} = {self.namespace[key]!r}\n" for key in ("PROJECT", "PACKAGE_DIR", "FOLDER"))
        wheel.writestr(f"{module}.py", (constants + RUNTIME).encode())
        pth = f"import {module}; {module}.ensure()\n{self.namespace['FOLDER']}\n"
        wheel.writestr(f"__editable__.{self.name}.pth", pth.encode())

    def __enter__(self) -> _LinkedFolder:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


class typed_editable_wheel(editable_wheel):  # setuptools' command naming
    def _select_strategy(self, name: str, tag: str, build_lib: Any) -> Any:
        mode = str(getattr(self, "mode", None) or "").lower()
        package_dir = dict(self.distribution.package_dir or {})
        if mode in {"strict", "compat"} or "" in package_dir or not package_dir:
            return super()._select_strategy(name, tag, build_lib)
        project = Path(self.project_dir)
        namespace = runtime_namespace(project, package_dir, project / "build" / f"__editable__.{name}-{tag}.typed")
        try:
            namespace["sync"](namespace["PROJECT"], package_dir, namespace["FOLDER"])
        except (OSError, NotImplementedError):  # no symlinks here: setuptools' import hook still runs
            return super()._select_strategy(name, tag, build_lib)
        return _LinkedFolder(name, tag, namespace)


setup(cmdclass={"editable_wheel": typed_editable_wheel})
