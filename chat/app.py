"""bitchat entry point (placeholder until issue 6 lands)."""
import sys


def main(argv=None) -> int:
    print("bitchat: not yet implemented", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
