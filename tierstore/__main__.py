"""``python -m tierstore``: the command line (what the ``tierstore`` script runs)."""

from .cli import main

main()
