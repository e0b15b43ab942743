"""Train many LoRA adapters of one frozen LLM at once (LoRAFusion, Lightning)."""

__version__ = "0.1.0"
