"""``python -m ddtree_devtools.serve ARGS``: ddtree-serve's own CLI, with the test fault switch.

DDTREE_TEST_STARTUP_DELAY_S holds the model load back that many seconds (so ``starting`` is observable).
Never run this in production: anyone who reaches the port can kill the engine.
"""

from __future__ import annotations

import os
import sys

from ddtree_runtime.server.cli import main

from ddtree_devtools.faults import create_faulty_app

STARTUP_DELAY_ENV = "DDTREE_TEST_STARTUP_DELAY_S"

if __name__ == "__main__":
    try:
        delay = float(os.environ.get(STARTUP_DELAY_ENV, "0"))
    except ValueError:
        sys.exit(f"{STARTUP_DELAY_ENV}: expected seconds")
    sys.exit(main(make_app=lambda config: create_faulty_app(config, delay)))
