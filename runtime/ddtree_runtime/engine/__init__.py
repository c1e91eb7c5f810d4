"""DDTree engine API: EngineConfig, SamplingParams, RoundOutput and Engine."""

from .engine import Engine
from .types import EngineConfig, RoundOutput, SamplingParams

__all__ = ["Engine", "EngineConfig", "RoundOutput", "SamplingParams"]
