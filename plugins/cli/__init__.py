"""The ``trainbus`` command line (``trainbus demo``)."""

from .demo import main

__all__ = ["main"]
