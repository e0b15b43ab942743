"""Multi-adapter generation engine (S-LoRA style): one base, many LoRA adapters per batch."""

from .adapters import AdapterInfo, UnknownAdapterError
from .config import EngineConfig
from .engine import Engine
from .request import GenerationRequest, GenerationResult, TokenEvent
from .sampling import SamplingParams

__all__ = ["AdapterInfo", "Engine", "EngineConfig", "GenerationRequest", "GenerationResult", "SamplingParams",
           "TokenEvent", "UnknownAdapterError"]
