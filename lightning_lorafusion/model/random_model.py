"""Random-weight Llama bases with no download: HF directories for tests and GPU smoke runs, and
``random:<shape>`` bases built directly on a device, one pipeline stage's layers at a time."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import torch

from ..specs import ConfigError
from .decoder import DecoderConfig

RANDOM_PREFIX = "random:"

# Shapes of public Llama 3.1 configs (meta-llama/Llama-3.1-8B and -70B config.json).
_LLAMA31_ROPE = dict(rope_theta=500000.0, rope_type="llama3", rope_factor=8.0, rope_low_freq_factor=1.0,
                     rope_high_freq_factor=4.0, rope_original_max_positions=8192,
                     max_position_embeddings=131072, rms_norm_eps=1e-5)
NAMED_SHAPES: dict[str, dict[str, Any]] = {
    "llama8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
                    num_heads=32, num_kv_heads=8, head_dim=128, **_LLAMA31_ROPE),
    "llama70b": dict(vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_layers=80,
                     num_heads=64, num_kv_heads=8, head_dim=128, **_LLAMA31_ROPE),
}


def is_random_base(name_or_path: str) -> bool:
    return str(name_or_path).startswith(RANDOM_PREFIX)


def random_base_config(name_or_path: str) -> DecoderConfig:
    """The ``DecoderConfig`` of ``random:<shape>``: a named shape (``llama8b``, ``llama70b``) or a
    path to an HF ``config.json`` (or a directory holding one); no weights are read."""
    if not is_random_base(name_or_path):
        raise ConfigError(f"{name_or_path!r} is not a random base; write 'random:<shape or config path>'")
    shape = str(name_or_path)[len(RANDOM_PREFIX):]
    if shape in NAMED_SHAPES:
        return DecoderConfig(model_type="llama", **NAMED_SHAPES[shape])
    path = Path(shape).expanduser()
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ConfigError(
            f"model.base_model={name_or_path!r}: after 'random:' give one of {sorted(NAMED_SHAPES)} "
            "or the path of an HF config.json (or of a directory holding one)"
        )
    from transformers import AutoConfig

    return DecoderConfig.from_hf(AutoConfig.from_pretrained(str(path)))


def _tensor_seed(seed: int, name: str) -> int:
    """A seed per (base seed, tensor name): a tensor's values do not depend on which stage or
    process draws it, nor on the order tensors are drawn in."""
    digest = hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def random_base_params(config: DecoderConfig, layers: range | None = None, *, is_first: bool = True,
                       is_last: bool = True, device: torch.device | str = "cpu",
                       dtype: torch.dtype = torch.float32, seed: int = 0, std: float = 0.02) -> dict[str, Any]:
    """Frozen random params of ``layers`` (default: all) drawn on ``device``, in the pytree layout
    of ``hf_loading.params_from_state_dict`` (``layers`` a dict by global index): matrices
    N(0, ``std``) (HF's ``initializer_range``), norms 1, biases 0. The embedding comes with
    ``is_first``, the final norm and LM head with ``is_last`` (the embedding's tensor when the
    config ties them). Nothing is allocated for other stages' layers."""
    device = torch.device(device)

    def normal(name: str, *shape: int) -> torch.Tensor:
        g = torch.Generator(device=device).manual_seed(_tensor_seed(seed, name))
        return torch.empty(shape, dtype=dtype, device=device).normal_(0.0, std, generator=g)

    def ones(n: int) -> torch.Tensor:
        return torch.ones(n, dtype=dtype, device=device)

    family = config.family
    biases = {"q_proj": config.qkv_bias, "k_proj": config.qkv_bias, "v_proj": config.qkv_bias,
              "qkv_proj": config.qkv_bias, "o_proj": config.o_bias, "gate_proj": config.mlp_bias,
              "up_proj": config.mlp_bias, "gate_up_proj": config.mlp_bias, "down_proj": config.mlp_bias}
    per_head = family.qk_norm == "head"
    norm_sizes = {"q_norm": config.head_dim if per_head else config.q_size,
                  "k_norm": config.head_dim if per_head else config.kv_size}
    params: dict[str, Any] = {"layers": {}}
    for i in range(config.num_layers) if layers is None else layers:
        # norms start at the identity: w = 1, or w = 0 where the family multiplies by 1 + w
        layer: dict[str, Any] = {name: ones(norm_sizes.get(name, config.hidden_size)) - family.norm_offset
                                 for name in family.norm_keys()}
        for module in family.projections:
            has_bias = biases[module]
            d_in, d_out = config.module_dims(module)
            layer[module] = {"weight": normal(f"layers.{i}.{module}", d_out, d_in)}
            if has_bias:
                layer[module]["bias"] = torch.zeros(d_out, dtype=dtype, device=device)
        params["layers"][i] = layer
    tied = config.tie_word_embeddings
    if is_first or (is_last and tied):
        params["embed"] = normal("embed", config.vocab_size, config.hidden_size)
    if is_last:
        params["norm"] = ones(config.hidden_size) - family.norm_offset
        params["lm_head"] = params["embed"] if tied else normal("lm_head", config.vocab_size, config.hidden_size)
        if tied and not is_first:
            params.pop("embed")  # only the head uses it here
    for t in _leaves(params):
        t.requires_grad_(False)
    return params


def _leaves(tree: Any):
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, dict):
        for v in tree.values():
            yield from _leaves(v)


def write_random_llama(path: Any, *, vocab_size: int = 256, hidden_size: int = 32, intermediate_size: int = 64,
                       num_layers: int = 2, num_heads: int = 4, num_kv_heads: int = 2, init_std: float = 0.08,
                       max_positions: int = 512, seed: int = 0) -> Any:
    """Write a random Llama (GQA) and a matching word-level tokenizer (tokens ``w0``, ``w1``, ...)
    to ``path``. Weights are drawn N(0, ``init_std``), norms 1: larger than HF's init for tiny
    models so that a loss visibly moves; pass ``init_std=0.02`` for large shapes."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    specials = ["<pad>", "<unk>", "<s>", "</s>"]
    vocab = {t: i for i, t in enumerate(specials + [f"w{i}" for i in range(vocab_size - len(specials))])}
    tok = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = Whitespace()
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    hf_tok.save_pretrained(path)
    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_positions, rms_norm_eps=1e-6, tie_word_embeddings=False, pad_token_id=0,
        bos_token_id=2, eos_token_id=3,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, init_std) if p.dim() > 1 else p.fill_(1.0)
    model.save_pretrained(path, safe_serialization=True)
    return path
