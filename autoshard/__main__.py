"""``python -m autoshard``: the command line (``autoshard.cli``)."""
import sys

from autoshard.cli import main

sys.exit(main())
