import sys

from ddtree_runtime.server.cli import main

sys.exit(main())
