"""How many pages the engine's unified pool gets: what the device leaves after the base, minus
an estimate of one step's activations."""

from __future__ import annotations

import torch

from ..kernels.lora_gather import MAX_RANK
from ..kernels.lora_segments import SHRINK_MAX_SPLITS
from ..kernels.lora_splitk import SPLIT_ROW_BUDGET
from ..model.decoder import DecoderConfig
from ..specs import ConfigError
from .config import EngineConfig
from .decode_graphs import token_buckets
from .engine_output import PROMPT_LOGPROB_CHUNK

# Activation headroom kept out of the pool on CUDA, beyond the per-token estimate.
CUDA_HEADROOM_BYTES = 512 * 2**20
# projections sharing one prefill LoRA shrink at most (q/k/v): the rows of its fp32 scratch S
MAX_GROUP = 3


def pool_pages(cfg: EngineConfig, mc: DecoderConfig, device: torch.device, dtype: torch.dtype) -> int:
    """Pages of the pool: ``cfg.num_pages`` if given, else ``cpu_pool_mib`` on a CPU, else the
    fraction ``gpu_memory_fraction`` of free GPU memory left after one step's activations."""
    elt = torch.empty((), dtype=dtype).element_size()
    page_bytes = mc.num_layers * 2 * cfg.page_size * mc.kv_size * elt
    if cfg.num_pages is not None:
        return cfg.num_pages
    if device.type != "cuda":
        return max(1, cfg.cpu_pool_mib * 2**20 // page_bytes)
    free, _ = torch.cuda.mem_get_info(device)
    per_token = (4 * mc.hidden_size + 3 * mc.intermediate_size + mc.q_size + 2 * mc.kv_size) * elt * 2
    reserve = (cfg.max_num_batched_tokens * per_token + CUDA_HEADROOM_BYTES
               + (cfg.max_num_seqs + PROMPT_LOGPROB_CHUNK) * mc.vocab_size * 4 * 3)
    if cfg.tuning.mixed_graphs in ("on", "auto"):
        # captured mixed steps keep a forward's temporaries in their graph pool (eager steps
        # need their own beside it), among them the prefill LoRA's scratch S, MAX_RANK wide in
        # fp32 per K split and projection (one set of pieces serves every rank), and static
        # buffers per token bucket: the buckets' rows summed (2 x max_num_batched_tokens with
        # powers of two, 3.4 x with the fine buckets; steps with adapters pad to every bucket,
        # base-only ones up to mixed_graph_max_tokens) (the split-K form splits small steps' K
        # more ways: at most SPLIT_ROW_BUDGET rows of S)
        static_row = (2 * mc.hidden_size + 4 * mc.q_size + 2 * mc.kv_size) * elt
        s_bytes = max(cfg.max_num_batched_tokens * SHRINK_MAX_SPLITS * MAX_GROUP, SPLIT_ROW_BUDGET) * MAX_RANK * 4
        static_rows = sum(token_buckets(cfg.max_num_batched_tokens, cfg.tuning.token_buckets))
        reserve += cfg.max_num_batched_tokens * per_token + static_rows * static_row + s_bytes
    pages = int((free * cfg.gpu_memory_fraction - reserve) // page_bytes)
    if pages < 1:
        raise ConfigError(f"no GPU memory left for the KV/adapter pool ({free / 2**30:.1f} GiB free, "
                          f"{reserve / 2**30:.1f} GiB kept for activations); lower "
                          "max_num_batched_tokens or free memory")
    return pages
