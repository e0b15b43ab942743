"""EngineConfig: pool size, batching limits and kernel backend of the generation engine, with its
execution modes (EngineTuning, whose defaults suit every device) nested under ``tuning``."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, fields
from typing import Any, Mapping

from ..kernels.options import NF4_GEMM_MODES
from ..kernels.skinny_gemm import DECODE_GEMM_MODES
from ..specs import ConfigError

BACKENDS = ("auto", "torch", "triton")
CUDA_GRAPHS = ("auto", "on", "off")
PREFILL_ATTENTION = ("auto", "varlen", "paged")
MIXED_GRAPHS = ("auto", "on", "off", "eager")
ASYNC_DECODE = ("auto", "on", "off")
SCHEDULING = ("fifo", "fair")
ON_OFF = ("on", "off")
HOST_TABLES = ("packed", "separate")
PAGE_IN_WAIT = ("layer", "step")
PREFILL_LORA_WRITE = ("auto", "on", "off")
CAPTURE_WARM_UP = ("first", "every")
DECODE_LORA_BESIDE = ("wide", "few")


@dataclass(frozen=True, kw_only=True)
class EngineTuning:
    """How the engine runs its steps, apart from what it computes: every mode's default
    ("auto", or None) picks the fastest path measured for the device and kernels, and the
    others exist to compare paths (benchmarks, tests) or to rule one out when debugging.
    ``EngineConfig(tuning=EngineTuning(mixed_graphs="off"))``."""

    decode_backend: str | None = None  # lora_gather + paged attention, if not ``backend``
    # attention of prompts prefilled from position 0: "varlen" (their own tokens, FlashAttention
    # varlen on CUDA), "paged" (over their pages, with the prefix hits and later chunks in one
    # paged prefill launch per layer), "auto" (the default: paged with the Triton kernels, varlen
    # with the torch ones; paged prefilled 6% faster at the 8B shape on an H100, docs/serving.md)
    prefill_attention: str = "auto"
    # steps with prefill rows padded to token buckets and run as pieces around attention
    # (mixed_graphs.py): "off" (one eager forward), "eager" (the pieces run eagerly: the CPU
    # path of the same code), "on" (each piece a CUDA graph; CUDA + Triton), "auto" (the
    # default: on where decode steps run as CUDA graphs). On the 1B Poisson trace on an H100,
    # on: 1.48x the tokens/s of off, time to first token p50 0.03 s against 1.81 s
    # (docs/BENCHMARKS.md, "Mixed steps as CUDA graphs")
    mixed_graphs: str = "auto"
    # overlapped decode (vLLM's async scheduling, SGLang's overlap scheduler): while a decode-only
    # step runs on the device, the next one (the same rows, each fed the token the running step
    # samples, copied on the device) is planned and launched before the running step's tokens
    # are read, so scheduling, detokenization and events overlap the device. A row that stops
    # on a stop token or string costs one discarded row in the step after. "auto" (the
    # default): on with CUDA; "on": also on a CPU (the same logic, nothing to overlap); "off"
    async_decode: str = "auto"
    # with the overlapped decode, the steps that admit queued requests are planned and launched
    # ahead too, their decode rows fed the running step's tokens on the device: "on" (the
    # default) where the scheduler can tell, before those tokens are read, what it would admit
    # (FIFO, the admissions' adapters resident, their KV pages free; ``Scheduler.plan_ahead``),
    # so the device does not idle while the host builds the step's tables; "off": such a step
    # waits for the running step's tokens (docs/serving.md "Mixed steps planned ahead")
    mixed_ahead: str = "on"
    # an NF4 base's frozen products (``KernelOptions.nf4_gemm``): "buffer" (dequantize each weight
    # into a scratch buffer, then a GEMM), "fused" (the NF4 GEMM reads the 4-bit weight in its
    # tiles; CUDA), "auto" (decode steps of at most 64 rows on CUDA: the NF4 decode kernel, which
    # reads the 4-bit weight once; larger products: buffer; docs/BENCHMARKS.md "NF4 frozen base")
    nf4_gemm: str = "auto"
    # adapters paged in ahead (``EngineConfig.prefetch_depth``): "on" (the default) also every
    # queued request the next step could admit (its token budget over their prompts), leaving
    # room for their KV pages; "off": only the first ``prefetch_depth`` queued requests
    prefetch_ahead: str = "on"
    # a step's host tables (token ids, positions, KV slots, LoRA tiles, page tables): "packed"
    # (the default: one host buffer, pinned on CUDA, one asynchronous copy; serving/staging.py)
    # or "separate" (one copy per table from pageable memory, each synchronous with the host)
    host_tables: str = "packed"
    # the prefill rows' LoRA: "on" writes it first into the projection's output (zeros on rows
    # without LoRA) and lets the frozen GEMM add its product onto it (cuBLAS's C input, beta = 1);
    # "off": the product first, then the LoRA read-added into it; "auto" (the default): written
    # first in steps whose adapted prefill rows are at least half their rows, added after in the
    # others (docs/serving.md "Prefill LoRA written first")
    prefill_lora_write: str = "auto"
    # a step admitting a request whose adapter's page-in copy is still running: "layer" (the
    # default) copies adapters in slices of one layer, an event after each, and orders each
    # layer of the step after its own slice only; "step": one copy, and the step's first kernel
    # waits for all of it (docs/serving.md "Page-ins by layer")
    page_in_wait: str = "layer"
    # a 16-bit base's frozen products of at most 256 rows (decode steps, the LM head, small mixed
    # steps): "triton" (``kernels/skinny_gemm``: split-K over the weight's rows, the split sum in
    # the launch, where it has a tiling for the row count), "cublas" (``F.linear``), "auto" (the
    # default: triton on CUDA; docs/serving.md "Frozen products of few rows")
    decode_gemm: str = "auto"
    # the token counts padded mixed steps are padded to (their pieces' buckets): "fine" (the
    # default: powers of two and, from 512 tokens, 3 * 2^k between them, so a compute-bound step
    # pads at most a third of its rows), "quarters" (5, 6 and 7 * 2^(k-2) between them: at most a
    # fifth, 8 buckets more under 8,192) or "pow2" (powers of two only; fewer pieces to capture)
    token_buckets: str = "fine"
    # mixed steps none of whose rows has an adapter padded to token buckets and run as pieces
    # only up to this many real tokens; larger ones run unpadded, eagerly (their products over
    # their own rows; the base pieces of the buckets above are not built): a count, "all" (every
    # bucket up to the step budget) or "auto" (the default: where a step's frozen products reach
    # ``decode_graphs.GRAPH_MAX_FLOPS``, from which a step is device-bound and a graph saves no
    # time: 2,048 tokens at the 8B shape). Steps with adapted rows pad to every bucket: eager,
    # their large steps paid a first-use compile of several seconds on an H100 (docs/serving.md)
    mixed_graph_max_tokens: int | str = "auto"
    # the Triton kernel variants compiled ahead (at the decode graphs' capture and in warm_up):
    # "on" (the default) keeps the list found by the first run beside the on-disk compile cache
    # and a restart of the same setup reads it instead of running every step's pieces to find it
    # again (serving/variant_record.py); "off" finds it every time
    kernel_variant_record: str = "on"
    # captures of the mixed-step pieces: "first" (the default) runs a piece eagerly before its
    # capture only when no piece of the same kind (first, last, or a layer of the same weight
    # shapes and RoPE) ran in that set yet: the others launch the same kernels on the same
    # shapes, already loaded and tuned; "every": each piece before its capture
    capture_warm_up: str = "first"
    # the decode rows' LoRA shrinks launched on a second CUDA stream beside the frozen GEMM that
    # reads their input (the o / down expands too, their rows added by the next norm): "wide" (the
    # default) in every decode step, the grouped shrink too, and in mixed steps (their decode rows'
    # shrinks and, where the prefill LoRA is added after the product, the prefill rows' shrink);
    # "few": only in decode steps of at most ``lora_gather.BESIDE_MAX_ROWS`` (64) rows, the rest in
    # stream order after the GEMMs (docs/serving.md "LoRA shrinks beside the GEMMs")
    decode_lora_beside: str = "wide"
    # attention's launches write their rows of the layer's output in place ("on", the default:
    # the mixed-step pieces' static buffer, or one new tensor), or ("off") each its own output,
    # concatenated and (pieces) copied into the static buffer: three passes over the step's
    # attention output a layer (docs/serving.md "Mixed steps as graphs")
    attention_in_place: str = "on"

    def __post_init__(self) -> None:
        if self.decode_backend is not None and self.decode_backend not in BACKENDS:
            raise ConfigError(f"EngineTuning.decode_backend={self.decode_backend!r}; allowed: {BACKENDS} or None")
        if self.prefill_attention not in PREFILL_ATTENTION:
            raise ConfigError(f"EngineTuning.prefill_attention={self.prefill_attention!r}; "
                              f"allowed: {PREFILL_ATTENTION}")
        if self.mixed_graphs not in MIXED_GRAPHS:
            raise ConfigError(f"EngineTuning.mixed_graphs={self.mixed_graphs!r}; allowed: {', '.join(MIXED_GRAPHS)}")
        if self.async_decode not in ASYNC_DECODE:
            raise ConfigError(f"EngineTuning.async_decode={self.async_decode!r}; allowed: {', '.join(ASYNC_DECODE)}")
        if self.mixed_ahead not in ON_OFF:
            raise ConfigError(f"EngineTuning.mixed_ahead={self.mixed_ahead!r}; allowed: {', '.join(ON_OFF)}")
        if self.prefetch_ahead not in ON_OFF:
            raise ConfigError(f"EngineTuning.prefetch_ahead={self.prefetch_ahead!r}; allowed: {', '.join(ON_OFF)}")
        if self.host_tables not in HOST_TABLES:
            raise ConfigError(f"EngineTuning.host_tables={self.host_tables!r}; allowed: {', '.join(HOST_TABLES)}")
        if self.prefill_lora_write not in PREFILL_LORA_WRITE:
            raise ConfigError(f"EngineTuning.prefill_lora_write={self.prefill_lora_write!r}; "
                              f"allowed: {', '.join(PREFILL_LORA_WRITE)}")
        if self.page_in_wait not in PAGE_IN_WAIT:
            raise ConfigError(f"EngineTuning.page_in_wait={self.page_in_wait!r}; allowed: {', '.join(PAGE_IN_WAIT)}")
        if self.token_buckets not in ("quarters", "fine", "pow2"):
            raise ConfigError(f"EngineTuning.token_buckets={self.token_buckets!r}; allowed: quarters, fine, pow2")
        if self.mixed_graph_max_tokens not in ("auto", "all") and (
                isinstance(self.mixed_graph_max_tokens, bool) or not isinstance(self.mixed_graph_max_tokens, int)
                or self.mixed_graph_max_tokens < 1):
            raise ConfigError(f"EngineTuning.mixed_graph_max_tokens={self.mixed_graph_max_tokens!r}; allowed: auto, "
                              "all or a token count >= 1")
        if self.attention_in_place not in ON_OFF:
            raise ConfigError(f"EngineTuning.attention_in_place={self.attention_in_place!r}; allowed: "
                              f"{', '.join(ON_OFF)}")
        if self.kernel_variant_record not in ON_OFF:
            raise ConfigError(f"EngineTuning.kernel_variant_record={self.kernel_variant_record!r}; "
                              f"allowed: {', '.join(ON_OFF)}")
        if self.capture_warm_up not in CAPTURE_WARM_UP:
            raise ConfigError(f"EngineTuning.capture_warm_up={self.capture_warm_up!r}; "
                              f"allowed: {', '.join(CAPTURE_WARM_UP)}")
        if self.decode_lora_beside not in DECODE_LORA_BESIDE:
            raise ConfigError(f"EngineTuning.decode_lora_beside={self.decode_lora_beside!r}; "
                              f"allowed: {', '.join(DECODE_LORA_BESIDE)}")
        if self.decode_gemm not in DECODE_GEMM_MODES:
            raise ConfigError(f"EngineTuning.decode_gemm={self.decode_gemm!r}; allowed: {', '.join(DECODE_GEMM_MODES)}")
        if self.nf4_gemm not in NF4_GEMM_MODES:
            raise ConfigError(f"EngineTuning.nf4_gemm={self.nf4_gemm!r}; allowed: {', '.join(NF4_GEMM_MODES)}")


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """Knobs of ``Engine``; the defaults suit one GPU.

    Pool size: ``num_pages`` if given; else on CUDA ``gpu_memory_fraction`` of the memory free
    after loading the base, minus an estimate of one step's activations; else (CPU)
    ``cpu_pool_mib``. A page holds ``page_size`` tokens of KV for every layer, or a piece of
    an adapter.
    """

    page_size: int = 16
    num_pages: int | None = None
    gpu_memory_fraction: float = 0.9
    cpu_pool_mib: int = 256
    max_num_seqs: int = 256  # running requests at most
    max_num_batched_tokens: int = 8192  # prefill + decode tokens per step
    # split prefills into chunks so every step stays within max_num_batched_tokens (decode rows
    # first, then prefill chunks); off: a prompt runs whole, one longer than the budget alone.
    # Off by default: it measured slower on the 1B Poisson trace (docs/BENCHMARKS.md, "Serving trace")
    enable_chunked_prefill: bool = False
    # prefill coalescing: while requests decode, new arrivals wait up to this many steps to be
    # prefilled together (a step with prefill rows costs more than a decode step, even as pieces);
    # 0 admits every arrival at the next step (docs/serving.md, "Scheduler")
    prefill_wait_steps: int = 0
    # which waiting request is admitted next: "fifo" (the oldest) or "fair" (the oldest of the
    # adapter served least so far, S-LoRA's virtual token counter: one adapter flooding the
    # queue does not hold the others' requests back; docs/serving.md, "Fair sharing")
    scheduling: str = "fifo"
    max_model_len: int | None = None  # prompt + generated; default the model's max positions
    backend: str = "auto"  # kernels: "torch" references, "triton", or "auto" (triton on CUDA)
    cuda_graphs: str = "auto"  # decode steps as CUDA graphs: "on", "off", "auto" (on with CUDA + Triton decode)
    prefetch_depth: int = 8  # queued requests whose adapters are paged in ahead, into free pages only
    kv_watermark: float = 0.01  # fraction of pages kept free when admitting (room for decode growth)
    prefix_caching: bool = True  # share full KV pages of equal leading tokens per adapter (docs/serving.md)
    # q/k/v and gate/up weights concatenated (one GEMM per group); the engine drops its references
    # to the originals, so a caller that shares its own weights (a training module) holds both: off there
    fuse_projections: bool = True
    seed: int = 0  # seeds the per-request generators of requests that give no seed
    # a JSON file of each adapter name's latest version, read at start and rewritten at every
    # new version: versions stay unique across restarts of the engine (None: they restart at 1)
    adapter_versions_file: str | None = None
    # execution modes a user need not set (their "auto" defaults suit every device); YAML: a
    # nested mapping (``tuning: {mixed_graphs: eager}``)
    tuning: EngineTuning = field(default_factory=EngineTuning)

    def __post_init__(self) -> None:
        if isinstance(self.tuning, Mapping):
            object.__setattr__(self, "tuning", EngineTuning(**self.tuning))
        elif not isinstance(self.tuning, EngineTuning):
            raise ConfigError(f"EngineConfig.tuning must be an EngineTuning or a mapping of its fields; "
                              f"got {type(self.tuning).__name__}")
        for name in ("page_size", "cpu_pool_mib", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ConfigError(f"EngineConfig.{name}={getattr(self, name)} must be >= 1")
        if self.num_pages is not None and self.num_pages < 1:
            raise ConfigError(f"EngineConfig.num_pages={self.num_pages} must be >= 1 (or None to size it)")
        if not 0.0 < self.gpu_memory_fraction <= 1.0:
            raise ConfigError(f"EngineConfig.gpu_memory_fraction={self.gpu_memory_fraction} must be in (0, 1]")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ConfigError(
                f"EngineConfig.max_num_batched_tokens={self.max_num_batched_tokens} must be >= "
                f"max_num_seqs={self.max_num_seqs} (every running request decodes one token per step)")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ConfigError(f"EngineConfig.max_model_len={self.max_model_len} must be >= 2")
        if self.backend not in BACKENDS:
            raise ConfigError(f"EngineConfig.backend={self.backend!r}; allowed: {BACKENDS}")
        if self.cuda_graphs not in CUDA_GRAPHS:
            raise ConfigError(f"EngineConfig.cuda_graphs={self.cuda_graphs!r}; allowed: {CUDA_GRAPHS}")
        if self.scheduling not in SCHEDULING:
            raise ConfigError(f"EngineConfig.scheduling={self.scheduling!r}; allowed: {', '.join(SCHEDULING)}")
        if self.prefill_wait_steps < 0:
            raise ConfigError(f"EngineConfig.prefill_wait_steps={self.prefill_wait_steps} must be >= 0")
        if self.prefetch_depth < 0:
            raise ConfigError(f"EngineConfig.prefetch_depth={self.prefetch_depth} must be >= 0")
        if not 0.0 <= self.kv_watermark < 1.0:
            raise ConfigError(f"EngineConfig.kv_watermark={self.kv_watermark} must be in [0, 1)")
        if self.adapter_versions_file is not None and (not isinstance(self.adapter_versions_file, str)
                                                       or not self.adapter_versions_file):
            raise ConfigError(f"EngineConfig.adapter_versions_file={self.adapter_versions_file!r} must be a file "
                              "path (or None to number versions from 1 in each process)")


# EngineConfig fields that moved into EngineTuning: passing one flat names its new place
MOVED_TO_TUNING = ("decode_backend", "prefill_attention", "mixed_graphs", "async_decode", "nf4_gemm")
# every EngineTuning field (those added there since, passed flat, get the same message)
TUNING_FIELDS = tuple(f.name for f in fields(EngineTuning))


def moved_key_error(name: str) -> ConfigError:
    return ConfigError(f"EngineConfig.{name} moved to EngineConfig.tuning.{name}: pass "
                       f"EngineConfig(tuning=EngineTuning({name}=...)), in YAML `engine: {{tuning: {{{name}: ...}}}}`, "
                       f"on the command line --engine.tuning.{name}")


def _refuse_moved_keys(init):
    """Wrap the dataclass's ``__init__``: a moved key raises ``moved_key_error`` (a ConfigError)
    instead of Python's TypeError about an unexpected argument. functools.wraps keeps the
    signature that jsonargparse reads."""

    @functools.wraps(init)
    def __init__(self, **kwargs: Any) -> None:
        for name in kwargs:
            if name in TUNING_FIELDS:
                raise moved_key_error(name)
        init(self, **kwargs)

    return __init__


EngineConfig.__init__ = _refuse_moved_keys(EngineConfig.__init__)
