"""Export one bank adapter as a standard HF PEFT LoRA directory, and import one back."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import tempfile
from pathlib import Path

import torch

from ..specs import (
    ADAPTABLE_MODULES,
    ALL_TARGET_MODULES,
    BASE_REWRITING_INITS,
    ConfigError,
    LoraLayout,
    module_path,
)
from .adapter_bank import AdapterBank

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# What an export writes into an adapter directory (trainer_state.json: training/evaluation.py;
# last/: the final weights of a validated adapter). Anything else found there is the user's.
EXPORTED_FILES = frozenset({CONFIG_FILE, WEIGHTS_FILE, "trainer_state.json"})
EXPORTED_DIRS = frozenset({"last"})
# Temporary directories an export makes beside its target: ".<name>.tmp-<random>" (being
# written) and ".<name>.old-<random>" (the replaced export, being removed).
_TEMP_DIR = re.compile(r"\.(?P<name>.+)\.(tmp|old)-[A-Za-z0-9_]{8}")


def peft_key(layer: int, module: str, factor: str) -> str:
    """HF PEFT's saved name, e.g. ``base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight``."""
    return f"base_model.model.{module_path(layer, module)}.{factor}.weight"


def peft_magnitude_key(layer: int, module: str) -> str:
    """HF PEFT's saved name of a DoRA magnitude (no ``.weight``), e.g.
    ``base_model.model.model.layers.3.self_attn.q_proj.lora_magnitude_vector``."""
    return peft_key(layer, module, "lora_magnitude_vector")[:-len(".weight")]


def export_peft_adapter(
    bank: AdapterBank,
    adapter_index: int,
    out_dir: str | os.PathLike,
    *,
    base_model_name_or_path: str | None = None,
    dtype: torch.dtype | None = None,
    extra_files: dict[str, str] | None = None,
) -> Path:
    """Write ``out_dir/adapter_config.json`` + ``adapter_model.safetensors`` (PEFT LoRA format).

    The directory is built next to ``out_dir`` and moved into place, so readers never see a
    half-written adapter. An existing ``out_dir`` is replaced only when it holds nothing but an
    earlier export's files (``check_export_target``); otherwise ``ConfigError``. Non-finite
    weights or alpha raise instead of being written. ``extra_files``: more files of
    ``EXPORTED_FILES`` (name -> text) written with it. ``dtype``: default the bank's.
    """
    from safetensors.torch import save_file

    spec = bank.specs[adapter_index]
    if not (math.isfinite(spec.alpha) and spec.alpha > 0 and spec.rank >= 1):
        raise ValueError(f"adapter {spec.name!r}: rank={spec.rank}, alpha={spec.alpha} cannot be exported "
                         "(adapter_config.json needs r >= 1 and a finite lora_alpha > 0)")
    tensors = {}
    for layer, module in spec.layout.adapted(bank.config.num_layers):
        f = bank.factors(adapter_index, layer, module)
        for factor, p in (("lora_A", f.lora_A), ("lora_B", f.lora_B)):
            t = p.detach().to("cpu", dtype or p.dtype).contiguous()
            tensors[peft_key(layer, module, factor)] = t
        if f.lora_magnitude is not None:
            m = f.lora_magnitude.detach()
            tensors[peft_magnitude_key(layer, module)] = m.to("cpu", dtype or m.dtype).contiguous()
    bad = next((k for k, t in tensors.items() if not bool(torch.isfinite(t).all())), None)
    if bad is not None:
        raise FloatingPointError(f"adapter {spec.name!r}: {bad} holds non-finite values; not exported")
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path,
        **spec.layout.peft_config(),  # r, lora_alpha, target_modules, use_rslora, patterns, layers
        "lora_dropout": spec.dropout,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_dora": spec.dora,
        "init_lora_weights": spec.init_lora_weights,
        "inference_mode": True,
        "modules_to_save": None,
    }
    check_export_target(out_dir)
    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_export_temporaries(out)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        os.chmod(tmp, 0o755)
        save_file(tensors, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2, allow_nan=False) + "\n")
        for name, text in (extra_files or {}).items():
            if name not in EXPORTED_FILES:
                raise ValueError(f"extra export file {name!r}; allowed: {sorted(EXPORTED_FILES)}")
            (tmp / name).write_text(text)
        _swap_into_place(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def check_export_target(out: str | os.PathLike) -> None:
    """Raise ``ConfigError`` unless ``out`` may be (re)placed by an export: it does not exist, or
    it is a real directory holding only what an export writes. An export removes nothing else."""
    raw = os.fspath(out)
    if os.path.basename(raw) in ("", ".", ".."):  # Path() would drop a trailing '.' silently
        raise ConfigError(f"export target {raw!r} does not end in an adapter name")
    out = Path(raw)
    if not out.exists() and not out.is_symlink():
        return
    if out.is_symlink() or not out.is_dir():
        raise ConfigError(f"export target {str(out)!r} exists and is not a directory; move it away or "
                          "choose another model.export_dir")
    foreign = _foreign_entries(out)
    if foreign:
        raise ConfigError(
            f"export target {str(out)!r} holds files an export did not write ({', '.join(foreign[:5])}); "
            "an export replaces the whole adapter directory, so move them away or choose another "
            "model.export_dir"
        )


def _foreign_entries(directory: Path, prefix: str = "") -> list[str]:
    found = []
    for entry in sorted(directory.iterdir()):
        if entry.is_symlink():
            found.append(prefix + entry.name)
        elif entry.is_dir() and entry.name in EXPORTED_DIRS and not prefix:
            found += _foreign_entries(entry, f"{entry.name}/")
        elif not (entry.is_file() and entry.name in EXPORTED_FILES):
            found.append(prefix + entry.name)
    return found


def remove_stale_export_temporaries(out: str | os.PathLike) -> None:
    """Remove ``.<name>.tmp-*`` / ``.<name>.old-*`` directories beside ``out`` that an earlier
    export of the same adapter left when it was killed (only directories named by this module)."""
    out = Path(out)
    if not out.parent.is_dir():
        return
    for entry in out.parent.iterdir():
        match = _TEMP_DIR.fullmatch(entry.name)
        if match and match.group("name") == out.name and entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)


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
    layout = peft_layout(cfg, targets, where)
    num_layers = bank.config.num_layers
    adapted = spec.layout.adapted(num_layers)
    mismatches = _layout_mismatches(layout, spec.layout, num_layers)
    if bool(cfg.get("use_dora", False)) != spec.dora:
        mismatches.append(f"dora: {bool(cfg.get('use_dora', False))} there, {spec.dora} in the config")
    if mismatches:
        raise ConfigError(f"{where} does not match the adapter's spec ({'; '.join(mismatches)}); set the adapter's "
                          "rank/alpha/target_modules/use_rslora/rank_pattern/alpha_pattern/layers_to_transform/"
                          "dora to the PEFT adapter's values")
    expected = {}
    for layer, module in adapted:
        f = bank.factors(adapter_index, layer, module)
        expected[peft_key(layer, module, "lora_A")] = f.lora_A
        expected[peft_key(layer, module, "lora_B")] = f.lora_B
        if f.lora_magnitude is not None:
            expected[peft_magnitude_key(layer, module)] = f.lora_magnitude
    missing = sorted(set(expected) - set(state))
    extra = sorted(set(state) - set(expected))
    if missing or extra:
        raise ConfigError(f"{where}: weight names do not match a {num_layers}-layer model "
                          f"(missing e.g. {missing[:3]}, unexpected e.g. {extra[:3]})")
    for key, param in expected.items():
        if tuple(state[key].shape) != tuple(param.shape):
            raise ConfigError(f"{where}: {key} has shape {tuple(state[key].shape)}, "
                              f"expected {tuple(param.shape)}; was it trained on another base model?")
    with torch.no_grad():
        for key, param in expected.items():
            param.copy_(state[key])


def _layout_mismatches(there: LoraLayout, here: LoraLayout, num_layers: int) -> list[str]:
    """How two layouts differ on a ``num_layers`` model: targets, adapted layers, and the first
    projection whose rank or scale differs (patterns are compared by what they resolve to)."""
    out = []
    if set(there.target_modules) != set(here.target_modules):
        out.append(f"target_modules: {sorted(there.target_modules)} there, {sorted(here.target_modules)} in the config")
    if there.rank != here.rank:
        out.append(f"rank: {there.rank} there, {here.rank} in the config")
    if float(there.alpha) != float(here.alpha):
        out.append(f"alpha: {there.alpha} there, {here.alpha} in the config")
    if there.use_rslora != here.use_rslora:
        out.append(f"use_rslora: {there.use_rslora} there, {here.use_rslora} in the config")
    if out:
        return out
    pairs_there, pairs_here = there.adapted(num_layers), here.adapted(num_layers)
    if pairs_there != pairs_here:
        layers = sorted({layer for layer, _ in pairs_there}), sorted({layer for layer, _ in pairs_here})
        return [f"adapted layers: {layers[0]} there, {layers[1]} in the config (layers_to_transform)"]
    for layer, module in pairs_here:
        rank_there, rank_here = there.module_rank(layer, module), here.module_rank(layer, module)
        if rank_there != rank_here:
            return [f"rank of layer {layer} {module}: {rank_there} there, {rank_here} in the config (rank_pattern)"]
        if there.module_alpha(layer, module) != here.module_alpha(layer, module):
            return [f"alpha of layer {layer} {module}: {there.module_alpha(layer, module)} there, "
                    f"{here.module_alpha(layer, module)} in the config (alpha_pattern)"]
    return []


def peft_layout(cfg: dict, targets: tuple[str, ...], where: str) -> LoraLayout:
    """The ``LoraLayout`` of a PEFT adapter_config.json (``targets``: ``read_peft_adapter``'s);
    an invalid value is a ``ConfigError`` naming ``where``."""
    rank, alpha = cfg.get("r"), cfg.get("lora_alpha")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ConfigError(f"{where}: adapter_config.json needs an integer r >= 1; got r={rank!r}")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha) or alpha <= 0:
        raise ConfigError(f"{where}: adapter_config.json needs a finite lora_alpha > 0; got lora_alpha={alpha!r}")
    return LoraLayout(rank=rank, alpha=float(alpha), target_modules=targets,
                      use_rslora=bool(cfg.get("use_rslora") or False),
                      rank_pattern=cfg.get("rank_pattern") or {}, alpha_pattern=cfg.get("alpha_pattern") or {},
                      layers_to_transform=cfg.get("layers_to_transform"),
                      layers_pattern=cfg.get("layers_pattern") or None, owner=where)


def read_peft_adapter(peft_dir: str | os.PathLike, where: str
                      ) -> tuple[dict, tuple[str, ...], dict[str, torch.Tensor]]:
    """Read a PEFT LoRA directory: (adapter_config.json as a dict, target modules in our order,
    weights keyed like ``peft_key``). Refuses, naming ``where``, the PEFT features this project
    does not implement (LoRA biases, extra saved modules, transposed weights, inits that
    rewrote the base weight) and targets outside the known projections (the Llama family's
    seven, and Phi-3's fused ``qkv_proj`` / ``gate_up_proj``). rsLoRA, rank/alpha patterns and
    ``layers_to_transform`` are read by ``peft_layout``; DoRA's magnitudes by the callers."""
    path = Path(peft_dir)
    if not (path / CONFIG_FILE).is_file():
        raise ConfigError(f"{where} has no {CONFIG_FILE}; is it a PEFT adapter directory?")
    cfg = json.loads((path / CONFIG_FILE).read_text())
    if cfg.get("peft_type") != "LORA":
        raise ConfigError(f"{where} is a {cfg.get('peft_type')!r} adapter; only LORA is supported")
    for flag in ("fan_in_fan_out",):
        if cfg.get(flag):
            raise ConfigError(f"{where} uses {flag}=true, which is not implemented here")
    init = cfg.get("init_lora_weights", True)
    if isinstance(init, str) and init.lower().startswith(BASE_REWRITING_INITS):
        raise ConfigError(f"{where} was initialised with init_lora_weights={init!r}, which rewrote its base "
                          "weight; its factors only work on that rewritten base, and one frozen base serves "
                          "every adapter here (convert it with PEFT's path_initial_model_for_weight_conversion "
                          "to a plain LoRA adapter first)")
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
    # some PEFT versions keep the adapter name in the key (".lora_A.default.weight"), and a DoRA
    # magnitude's ".weight" (saved without it since)
    state = {k.replace(".default.weight", ".weight"): v for k, v in state.items()}
    return {k[:-len(".weight")] if k.endswith(".lora_magnitude_vector.weight") else k: v for k, v in state.items()}
