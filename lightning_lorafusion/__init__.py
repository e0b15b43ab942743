"""Train many LoRA adapters of one frozen LLM at once (LoRAFusion, Lightning), and serve them.

The public API is importable from here (``from lightning_lorafusion import LoRAFusionModule``) and
loaded on first use (PEP 562): ``import lightning_lorafusion`` itself imports nothing heavy.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# exported name -> the module that defines it
_EXPORTS = {
    "AdapterSpec": "lightning_lorafusion.specs",
    "ConfigError": "lightning_lorafusion.specs",
    "PlannerConfig": "lightning_lorafusion.planner.config",
    "PlanningError": "lightning_lorafusion.planner.config",
    "DecoderConfig": "lightning_lorafusion.model.decoder_config",
    "DecoderOptions": "lightning_lorafusion.model.decoder",
    "AdapterBank": "lightning_lorafusion.model.adapter_bank",
    "export_peft_adapter": "lightning_lorafusion.model.peft_io",
    "import_peft_adapter": "lightning_lorafusion.model.peft_io",
    "MultiAdapterPipelineStrategy": "lightning_lorafusion.parallel.strategy",
    "Engine": "lightning_lorafusion.serving.engine",
    "EngineConfig": "lightning_lorafusion.serving.config",
    "SamplingParams": "lightning_lorafusion.serving.sampling",
    "GenerationRequest": "lightning_lorafusion.serving.request",
    "GenerationResult": "lightning_lorafusion.serving.request",
    "LoRAFusionModule": "lightning_lorafusion.training.module",
    "MultiAdapterDataModule": "lightning_lorafusion.training.datamodule",
    "PlanningConfig": "lightning_lorafusion.training.epoch_planning",
    "PrecisionConfig": "lightning_lorafusion.training.precision",
    "Fp8Config": "lightning_lorafusion.training.precision",
    "TokenThroughput": "lightning_lorafusion.training.callbacks",
    "RunSummary": "lightning_lorafusion.training.callbacks",
    "PublishToEngine": "lightning_lorafusion.training.engine_publish",
}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:  # for type checkers and IDEs; never run
    from .model.adapter_bank import AdapterBank
    from .model.decoder import DecoderOptions
    from .model.decoder_config import DecoderConfig
    from .model.peft_io import export_peft_adapter, import_peft_adapter
    from .parallel.strategy import MultiAdapterPipelineStrategy
    from .planner.config import PlannerConfig, PlanningError
    from .serving.config import EngineConfig
    from .serving.engine import Engine
    from .serving.request import GenerationRequest, GenerationResult
    from .serving.sampling import SamplingParams
    from .specs import AdapterSpec, ConfigError
    from .training.callbacks import RunSummary, TokenThroughput
    from .training.datamodule import MultiAdapterDataModule
    from .training.engine_publish import PublishToEngine
    from .training.epoch_planning import PlanningConfig
    from .training.module import LoRAFusionModule
    from .training.precision import Fp8Config, PrecisionConfig


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'lightning_lorafusion' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # the next lookup does not come here
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
