"""`python -m simd`: print CPU features and the chosen kernel path."""
import sys

from engine.commands.info import main

sys.exit(main(None))
