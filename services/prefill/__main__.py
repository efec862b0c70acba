"""The prefill role of the engine host (see services/engine)."""

import sys

from common.roles import Role
from services.engine import server


def main() -> int:
    return server.main(default_role=Role.PREFILL)


if __name__ == "__main__":
    sys.exit(main())
