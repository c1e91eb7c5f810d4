"""Fixtures of the reliability suite (the helpers live in faultlab.py)."""

import json
import os

from faultlab import FIGURES, base  # noqa: F401 - base: the shared pivoted state, a session fixture


def pytest_sessionfinish(session, exitstatus):
    target = os.environ.get("DDOPS_RELIABILITY_FIGURES")
    if target and FIGURES:
        with open(target, "w") as fh:
            json.dump(FIGURES, fh, indent=1, sort_keys=True)
