"""Random-weight Llama directories (weights + a word-level tokenizer) for tests and GPU smoke
runs: everything `load_base_model` needs, with no download."""

from __future__ import annotations

from typing import Any

import torch


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
