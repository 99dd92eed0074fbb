"""``python -m opweave.cli``: the same as the ``opweave`` command."""

from .app import _console_main

_console_main()
