"""The Hugging Face style facade: ``TrainingArguments`` composed into plugins on a ``Trainer``; HF callbacks.

transformers is optional (the facade runs without it), but where it is installed the facade follows it:
the port's tests run on the releases from ``MIN_TRANSFORMERS`` on, and an older one is refused here, at
import, rather than failing later in some method.
"""

from __future__ import annotations

import re
import sys
from importlib import metadata

#: the oldest transformers the port is tested on (setup.cfg's extras say the same): 4.57.0 was withdrawn (yanked)
MIN_TRANSFORMERS = "4.57.1"


def installed_transformers() -> str | None:
    """The installed transformers' version (the imported module's, when it is imported); None without one."""
    module = sys.modules.get("transformers")
    version = getattr(module, "__version__", None)
    if isinstance(version, str):
        return version
    try:
        return metadata.version("transformers")
    except metadata.PackageNotFoundError:
        return None


def release(version: str) -> tuple[int, int, int]:
    """``(major, minor, patch)`` of a version string ("4.57.0.dev0" -> (4, 57, 0))."""
    found = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", version)
    if found is None:
        raise ValueError(f"not a release version: {version!r}")
    major, minor, patch = found.groups(default="0")
    return int(major), int(minor), int(patch)


def check_transformers(version: str | None) -> None:
    """ImportError naming both versions when ``version`` is older than ``MIN_TRANSFORMERS``; None passes."""
    if version is not None and release(version) < release(MIN_TRANSFORMERS):
        raise ImportError(
            f"trainbus's Hugging Face style facade (trainbus.plugins.Trainer) needs transformers >= "
            f"{MIN_TRANSFORMERS}, and transformers {version} is installed: upgrade it "
            f"(pip install 'transformers>={MIN_TRANSFORMERS}') or uninstall it (the facade runs without transformers)"
        )


check_transformers(installed_transformers())
