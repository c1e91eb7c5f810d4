"""DDTree engine API: EngineConfig, SamplingParams, RoundOutput, WarmUp and Engine."""

from .engine import Engine
from .types import EngineConfig, RoundOutput, SamplingParams, WarmUp

__all__ = ["Engine", "EngineConfig", "RoundOutput", "SamplingParams", "WarmUp"]
