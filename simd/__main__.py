"""`python -m simd`: print CPU features and the chosen kernel path."""
import sys

from engine.errors import BitNetError


def _main() -> int:
    try:
        from engine.commands.info import main

        return main(None)
    except BitNetError as e:  # e.g. BITNET_ISA naming a path this CPU cannot run
        print(f"python -m simd: error: {e}", file=sys.stderr)
        return e.exit_code


sys.exit(_main())
