"""Stand-alone scripts that run on a remote host with its own python3 (stdlib only).

Each gathers what ddops needs from a host in one SSH round trip and prints one JSON object.
"""

from importlib import resources


def probe_source(name: str) -> str:
    """The text of probe `name` (e.g. "facts"), to send as `python3 -c TEXT ARGS`."""
    return resources.files(__package__).joinpath(f"{name}.py").read_text()
