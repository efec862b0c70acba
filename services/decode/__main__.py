"""The decode role of the engine host (see services/engine)."""
import sys

from services.engine import server


def main() -> int:
    return server.main(default_role="decode")


if __name__ == "__main__":
    sys.exit(main())
