import sys

from services.kvstore.server import main

if __name__ == "__main__":
    sys.exit(main())
