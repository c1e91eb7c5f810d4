"""The lab's one error type: what went wrong and the command that fixes it."""

from __future__ import annotations

from ..errors import DdopsError


class LabError(DdopsError):
    """The lab cannot be brought up, down or inspected (not root, a tool missing, a port taken...)."""
