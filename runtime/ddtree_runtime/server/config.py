"""Server settings, fixed at start-up: one field per serve setting (settings.py), with its default."""

from __future__ import annotations

from ..settings import ENGINE_SETTINGS, SERVE_SETTINGS, config_class


def _engine_kwargs(self) -> dict:
    """The engine's settings, as EngineConfig takes them (built on the worker thread)."""
    return {s.name: getattr(self, s.name) for s in ENGINE_SETTINGS}


ServerConfig = config_class("ServerConfig", __name__, SERVE_SETTINGS, "The server's settings (settings.py).",
                            namespace={"engine_kwargs": _engine_kwargs})
