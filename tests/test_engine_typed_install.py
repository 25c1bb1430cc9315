"""mypy finds trainbus's types after the README's ``pip install -e .``, and after a normal install (#28 item 9).

setuptools' default editable install of setup.cfg's folder mapping is an import hook mypy never runs, so a
user's mypy said "Cannot find implementation or library stub for module named trainbus.engine" and a
handler written for the wrong event passed. Each test installs trainbus into a fresh environment (a venv
whose only other path is this interpreter's site-packages, for torch and mypy), writes a user script in a
folder outside the repository, and expects mypy to report exactly the handler typed for the wrong event.
Each takes ~10 s: an install and a mypy run.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

USER_SCRIPT = """\
from trainbus.engine import Engine, Event, LossEvent


def on_loss(ev: LossEvent) -> None:
    print(ev.loss)


def register(engine: Engine) -> None:
    engine.on(Event.LOSS, on_loss)
    engine.on(Event.STEP_END, on_loss)  # line 10: the wrong event for this handler
"""

MYPY_INI = """\
[mypy]
[mypy-torch.*,numpy.*]
follow_imports = skip
"""


def fresh_environment(where: Path) -> Path:
    """A venv seeing this interpreter's site-packages as a plain path (their .pth hooks do not run there)."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(where)], check=True)
    python = where / "bin" / "python"
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             check=True, capture_output=True, text=True).stdout.strip()  # fmt: skip
    Path(purelib, "shared.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return python


def mypy_on_user_script(python: Path, folder: Path) -> str:
    folder.mkdir()
    (folder / "user.py").write_text(USER_SCRIPT)
    (folder / "mypy.ini").write_text(MYPY_INI)
    result = subprocess.run([str(python), "-m", "mypy", "--no-incremental", "user.py"], cwd=folder,
                            capture_output=True, text=True)  # fmt: skip
    return result.stdout + result.stderr


@pytest.mark.skipif(sys.platform == "win32", reason="the venv layout below is POSIX's")
@pytest.mark.parametrize("editable", [True, False], ids=["pip install -e .", "pip install ."])
def test_mypy_reports_a_handler_typed_for_the_wrong_event(tmp_path: Path, editable: bool) -> None:
    python = fresh_environment(tmp_path / "venv")
    install = [str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation"]
    subprocess.run([*install, *(["-e"] if editable else []), str(ROOT)], check=True, capture_output=True)
    output = mypy_on_user_script(python, tmp_path / "user")
    assert "Cannot find implementation" not in output, output
    assert 'user.py:10: error: Argument 2 to "on" of "Engine" has incompatible type' in output, output
    assert '"Callable[[LossEvent], None]"; expected "Callable[[StepEndEvent], None]"' in output, output
    assert "Found 1 error in 1 file" in output, output


NEW_MODULE = "def twice(x: int) -> int:\n    return 2 * x\n"
NEW_MODULE_USER = "from trainbus.brand_new import twice\n\ntwice('a')\n"


def throwaway_checkout(where: Path) -> Path:
    """A git repository holding this checkout's files as they are now (tracked and new, not the ignored)."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            check=True, capture_output=True).stdout.decode().split("\0")  # fmt: skip
    for name in filter(None, listed):
        if (ROOT / name).is_file():
            (where / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(ROOT / name, where / name)
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(where)]
    for command in (["init", "-q"], ["add", "-A"], ["commit", "-q", "-m", "copy"]):
        subprocess.run([*git, *command], check=True, capture_output=True)
    return where


@pytest.mark.skipif(sys.platform == "win32", reason="the venv layout below is POSIX's")
@pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(), reason="needs git and a checkout")
def test_the_editable_install_survives_git_clean_and_shows_new_modules(tmp_path: Path) -> None:
    """#37 item 7: ``git clean -xdf`` (or ``rm -rf build``) broke ``import trainbus`` in every venv installed
    editable from the checkout, and a module new in trainbus_root/ needed a reinstall; mypy still sees both."""
    checkout = throwaway_checkout(tmp_path / "checkout")
    python = fresh_environment(tmp_path / "venv")
    install = [str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "-e", str(checkout)]
    subprocess.run(install, check=True, capture_output=True)
    subprocess.run(["git", "clean", "-xdfq"], cwd=checkout, check=True)
    assert not (checkout / "build").exists()
    output = mypy_on_user_script(python, tmp_path / "user")  # mypy first: its own Python start repairs the links
    assert "Cannot find implementation" not in output, output
    assert "Found 1 error in 1 file" in output, output
    imported = subprocess.run([str(python), "-c", "import trainbus.plugins.checkpoints, trainbus.engine as e; "
                               "print(e.__name__)"], capture_output=True, text=True)  # fmt: skip
    assert imported.returncode == 0 and imported.stdout.strip() == "trainbus.engine", imported.stderr
    (checkout / "trainbus_root" / "brand_new.py").write_text(NEW_MODULE)
    new = subprocess.run([str(python), "-c", "import trainbus.brand_new as b; print(b.twice(2))"],
                         capture_output=True, text=True)  # fmt: skip
    assert new.returncode == 0 and new.stdout.strip() == "4", new.stderr
    (tmp_path / "user" / "user.py").write_text(NEW_MODULE_USER)
    checked = subprocess.run([str(python), "-m", "mypy", "--no-incremental", "user.py"], cwd=tmp_path / "user",
                             capture_output=True, text=True)  # fmt: skip
    assert 'user.py:3: error: Argument 1 to "twice" has incompatible type "str"' in checked.stdout, checked.stdout
    (checkout / "trainbus_root" / "brand_new.py").unlink()
    gone = subprocess.run([str(python), "-c", "import trainbus.brand_new"], capture_output=True, text=True)
    assert "No module named 'trainbus.brand_new'" in gone.stderr, gone.stderr
