"""A transformers + bitsandbytes NF4 checkpoint of a tiny model, for the NF4 loading tests."""

from __future__ import annotations

import shutil

import pytest
import torch


def write_bnb_checkpoint(src, dst, *, double_quant=True):
    """Quantize the HF model in ``src`` with transformers' ``BitsAndBytesConfig(load_in_4bit=True,
    bnb_4bit_quant_type="nf4")`` (bitsandbytes runs on the CPU) and ``save_pretrained`` it to
    ``dst`` with ``src``'s tokenizer files, as the ``*-bnb-4bit`` Hub repos are made. Returns
    the 4-bit transformers model."""
    pytest.importorskip("bitsandbytes", reason="bitsandbytes is not installed")
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors", "*.bin", "config.json"))
    qc = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=double_quant,
                            bnb_4bit_compute_dtype=torch.float32)
    model = AutoModelForCausalLM.from_pretrained(src, quantization_config=qc, device_map="cpu")
    model.save_pretrained(dst)
    return model
