"""The profile's secrets, read from the control machine's environment at the start of a run; they go
to the host's EnvironmentFile (mode 0600) and never into a plan, a diff, a report or the history."""

from __future__ import annotations

import os

from .errors import ConfigError
from .profile import Profile


def read_secrets(profile: Profile) -> dict[str, str]:
    values = {}
    for key, source in profile.secrets.items():
        value = os.environ.get(source)
        if not value:
            raise ConfigError(f"secret {key} comes from ${source}, which is not set", where=profile.where("secrets"),
                              fix=f"export {source}=... before running ddops")
        values[key] = value
    return values
