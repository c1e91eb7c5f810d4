"""Fixtures of the reliability suite (the helpers live in faultlab.py)."""

from faultlab import base  # noqa: F401 - the shared pivoted state, a session fixture
