import sys

from services.engine.server import main

if __name__ == "__main__":
    sys.exit(main())
