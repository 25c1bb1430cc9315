"""``python -m trainbus.plugins.cli demo``: the same as the ``trainbus`` command."""

import sys

from .demo import main

sys.exit(main())
