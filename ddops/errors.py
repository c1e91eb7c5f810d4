"""Typed errors that the CLI turns into one clear line and an exit code.

Exit codes follow Ansible: 0 ok, 2 user/config error or a failed step, 4 a host unreachable; and 1 when
`ddops top --fail-on` finds one of the alarms it was asked about, 3 an internal error (a bug in ddops:
the CLI writes a crash log and names it), 130 interrupted.
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_ALARM = 1
EXIT_FAILED = 2
EXIT_INTERNAL = 3
EXIT_UNREACHABLE = 4


class DdopsError(Exception):
    """An error the user can act on: what went wrong, where, and how to fix it."""

    exit_code = EXIT_FAILED

    def __init__(self, what: str, *, where: str | None = None, fix: str | None = None) -> None:
        super().__init__(what)
        self.what = what
        self.where = where
        self.fix = fix

    def line(self) -> str:
        text = f"{self.where}: {self.what}" if self.where else self.what
        return f"{text} ({self.fix})" if self.fix else text


class ConfigError(DdopsError):
    """A malformed inventory, profile or template."""


class UsageError(DdopsError):
    """A command-line option that cannot be honoured (unknown host in --limit, ...)."""


class StepFailed(DdopsError):
    """A plan step failed on a host."""


class Refused(StepFailed):
    """A step declined to act, as the run's limits say it must, and left the host as it was (a training
    stop that would still lose more steps than allowed after its checkpoint request)."""


class HostUnreachable(DdopsError):
    """A host could not be reached over SSH."""

    exit_code = EXIT_UNREACHABLE
