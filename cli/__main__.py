"""``python -m moetrace.cli``: the same as the ``moetrace`` command."""

from .app import main

main()
