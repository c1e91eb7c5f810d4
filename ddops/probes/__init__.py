"""Stand-alone scripts that read a host (stdlib only), run there with its own python3.

Each gathers what ddops needs from a host in one SSH round trip and prints one JSON object. Scripts
that change a host live next door, in `ddops.actions`; `probe_source` serves both.
"""

from importlib import resources

# Scripts travel as one text each, so code they share is prepended to their text here.
_SHARED_PARTS = {"smoke": ("loopback_chat",), "bench": ("loopback_chat", "hostlib"), "facts": ("hostlib", "gpuhealth"),
                 "inspect": ("hostlib",), "stop_training": ("hostlib",), "lock": ("hostlib",), "unitfile": ("hostlib",),
                 "balancer": ("hostlib",)}
_ACTIONS = ("unitfile", "stop_training", "lock", "balancer")


def probe_source(name: str) -> str:
    """The text of probe or action `name` (e.g. "facts"), to send as `python3 -c TEXT ARGS`."""
    parts = [*_SHARED_PARTS.get(name, ()), name]
    return "\n\n".join(resources.files("ddops.actions" if part in _ACTIONS else __package__)
                       .joinpath(f"{part}.py").read_text() for part in parts)

