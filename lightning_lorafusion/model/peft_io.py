"""Export one bank adapter as a standard HF PEFT LoRA directory, and import one back."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

from ..specs import ADAPTABLE_MODULES, ALL_TARGET_MODULES, ATTENTION_MODULES, ConfigError
from .adapter_bank import AdapterBank

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"


def peft_key(layer: int, module: str, factor: str) -> str:
    """HF PEFT's saved name, e.g. ``base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight``."""
    block = "self_attn" if module in ATTENTION_MODULES or module == "qkv_proj" else "mlp"
    return f"base_model.model.model.layers.{layer}.{block}.{module}.{factor}.weight"


def export_peft_adapter(
    bank: AdapterBank,
    adapter_index: int,
    out_dir: str | os.PathLike,
    *,
    base_model_name_or_path: str | None = None,
    dtype: torch.dtype | None = None,
) -> Path:
    """Write ``out_dir/adapter_config.json`` + ``adapter_model.safetensors`` (PEFT LoRA format).

    The directory is built next to ``out_dir`` and moved into place, so readers never see a
    half-written adapter; an existing ``out_dir`` is replaced. ``dtype``: default the bank's.
    """
    from safetensors.torch import save_file

    spec = bank.specs[adapter_index]
    tensors = {}
    for layer in range(bank.config.num_layers):
        for module in spec.target_modules:
            f = bank.factors(adapter_index, layer, module)
            for factor, p in (("lora_A", f.lora_A), ("lora_B", f.lora_B)):
                t = p.detach().to("cpu", dtype or p.dtype).contiguous()
                tensors[peft_key(layer, module, factor)] = t
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path,
        "r": spec.rank,
        "lora_alpha": spec.alpha,
        "lora_dropout": spec.dropout,
        "target_modules": [m for m in ADAPTABLE_MODULES if m in spec.target_modules],
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
        "layers_to_transform": None,
        "rank_pattern": {},
        "alpha_pattern": {},
    }
    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        os.chmod(tmp, 0o755)
        save_file(tensors, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
        _swap_into_place(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def _swap_into_place(tmp: Path, out: Path) -> None:
    if not out.exists():
        os.replace(tmp, out)
        return
    # a directory cannot be atomically replaced by a non-empty one: move the old aside first
    old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
    os.replace(out, old / out.name)
    os.replace(tmp, out)
    shutil.rmtree(old, ignore_errors=True)


def import_peft_adapter(bank: AdapterBank, adapter_index: int, peft_dir: str | os.PathLike) -> None:
    """Load a PEFT LoRA adapter's weights into bank adapter ``adapter_index`` (to continue
    training). Its rank, alpha and target modules must equal the adapter's spec."""
    spec = bank.specs[adapter_index]
    where = f"adapter {spec.name!r}: init_from {str(peft_dir)!r}"
    cfg, targets, state = read_peft_adapter(peft_dir, where)
    mismatches = []
    if cfg.get("r") != spec.rank:
        mismatches.append(f"rank: {cfg.get('r')} there, {spec.rank} in the config")
    if float(cfg.get("lora_alpha", -1)) != float(spec.alpha):
        mismatches.append(f"alpha: {cfg.get('lora_alpha')} there, {spec.alpha} in the config")
    if set(targets) != set(spec.target_modules):
        mismatches.append(f"target_modules: {sorted(targets)} there, {sorted(spec.target_modules)} in the config")
    if mismatches:
        raise ConfigError(f"{where} does not match the adapter's spec ({'; '.join(mismatches)}); "
                          "set the adapter's rank/alpha/target_modules to the PEFT adapter's values")
    expected = {}
    for layer in range(bank.config.num_layers):
        for module in spec.target_modules:
            f = bank.factors(adapter_index, layer, module)
            expected[peft_key(layer, module, "lora_A")] = f.lora_A
            expected[peft_key(layer, module, "lora_B")] = f.lora_B
    missing = sorted(set(expected) - set(state))
    extra = sorted(set(state) - set(expected))
    if missing or extra:
        raise ConfigError(f"{where}: weight names do not match a {bank.config.num_layers}-layer model "
                          f"(missing e.g. {missing[:3]}, unexpected e.g. {extra[:3]})")
    for key, param in expected.items():
        if tuple(state[key].shape) != tuple(param.shape):
            raise ConfigError(f"{where}: {key} has shape {tuple(state[key].shape)}, "
                              f"expected {tuple(param.shape)}; was it trained on another base model?")
    with torch.no_grad():
        for key, param in expected.items():
            param.copy_(state[key])


def read_peft_adapter(peft_dir: str | os.PathLike, where: str
                      ) -> tuple[dict, tuple[str, ...], dict[str, torch.Tensor]]:
    """Read a PEFT LoRA directory: (adapter_config.json as a dict, target modules in our order,
    weights keyed like ``peft_key``). Refuses, naming ``where``, the PEFT features this project
    does not implement (DoRA, rsLoRA, per-layer rank/alpha patterns, LoRA biases, extra saved
    modules, transposed weights) and targets outside the known projections (the Llama family's seven,
    and Phi-3's fused ``qkv_proj`` / ``gate_up_proj``)."""
    path = Path(peft_dir)
    if not (path / CONFIG_FILE).is_file():
        raise ConfigError(f"{where} has no {CONFIG_FILE}; is it a PEFT adapter directory?")
    cfg = json.loads((path / CONFIG_FILE).read_text())
    if cfg.get("peft_type") != "LORA":
        raise ConfigError(f"{where} is a {cfg.get('peft_type')!r} adapter; only LORA is supported")
    for flag in ("use_dora", "use_rslora", "fan_in_fan_out"):
        if cfg.get(flag):
            raise ConfigError(f"{where} uses {flag}=true, which is not implemented here")
    if cfg.get("rank_pattern") or cfg.get("alpha_pattern") or cfg.get("layers_to_transform"):
        raise ConfigError(f"{where} uses rank_pattern/alpha_pattern/layers_to_transform; not supported")
    if cfg.get("bias", "none") != "none" or cfg.get("modules_to_save"):
        raise ConfigError(f"{where} trains biases or saves extra modules (bias={cfg.get('bias')!r}, "
                          f"modules_to_save={cfg.get('modules_to_save')!r}); only plain LoRA factors "
                          "are supported")
    targets = cfg.get("target_modules")
    targets = set(ALL_TARGET_MODULES) if targets == "all-linear" else targets
    if isinstance(targets, str) or not targets or not set(targets) <= set(ADAPTABLE_MODULES):
        raise ConfigError(f"{where} targets {targets!r}; supported: a subset of {list(ADAPTABLE_MODULES)}")
    ordered = tuple(m for m in ADAPTABLE_MODULES if m in set(targets))
    return cfg, ordered, _read_peft_weights(path, where)


def _read_peft_weights(path: Path, where: str) -> dict[str, torch.Tensor]:
    if (path / WEIGHTS_FILE).is_file():
        from safetensors.torch import load_file

        state = load_file(str(path / WEIGHTS_FILE))
    elif (path / "adapter_model.bin").is_file():
        state = torch.load(path / "adapter_model.bin", map_location="cpu", weights_only=True)
    else:
        raise ConfigError(f"{where} has no {WEIGHTS_FILE} (or adapter_model.bin)")
    # some PEFT versions keep the adapter name in the key (".lora_A.default.weight")
    return {k.replace(".default.weight", ".weight"): v for k, v in state.items()}
