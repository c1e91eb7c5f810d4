"""Stand-alone scripts that run on a remote host with its own python3 (stdlib only).

Each gathers what ddops needs from a host in one SSH round trip and prints one JSON object.
"""

from importlib import resources


# Probes travel as one script each, so code they share is prepended to their text here.
_SHARED_PARTS = {"smoke": ("loopback_chat",), "bench": ("loopback_chat",)}


def probe_source(name: str) -> str:
    """The text of probe `name` (e.g. "facts"), to send as `python3 -c TEXT ARGS`."""
    files = resources.files(__package__)
    parts = [*_SHARED_PARTS.get(name, ()), name]
    return "\n\n".join(files.joinpath(f"{part}.py").read_text() for part in parts)
