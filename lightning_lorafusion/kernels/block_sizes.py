"""Per-device block sizes of the fused LoRA kernels: a shipped JSON table plus safe defaults.

``block_sizes.json`` (written by ``scripts/tune_kernels.py``) maps a CUDA device name, as
``torch.cuda.get_device_name`` spells it, to the fields of ``LoraBlockSizes``. Devices not in
the table get the defaults, which are correct everywhere and reasonable on Ampere/Hopper.
Nothing is read or queried at import time.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import dataclass
from pathlib import Path

import torch

# Every block_m in the table divides this, so segments padded to it line up with any device's
# routing tiles. The data layer pads adapter segments to ``pad_multiple()``.
PAD_MULTIPLE = 128

GEMM_MODES = ("cublas", "triton", "cublas_accumulate")

_TABLE_PATH = Path(__file__).with_name("block_sizes.json")


def pad_multiple() -> int:
    """Token multiple the data layer should pad each adapter segment to (kernels stay correct,
    only slightly slower, when segments are not padded)."""
    return PAD_MULTIPLE


@dataclass(frozen=True, kw_only=True)
class LoraBlockSizes:
    """Tile shapes. ``block_m`` is shared by the GEMMs and the routing table's row tiles.

    Forward GEMM ``Y = X W^T``: ``fwd_block_n`` x ``fwd_block_k`` tiles. Backward ``dX = dY W``:
    ``dx_block_k`` output columns, ``dx_block_n`` reduction step. The skinny rank kernels
    (S, dS, dB, dA) use ``skinny_block_k`` along the long dimension and ``rank_block`` along
    the rank.
    """

    block_m: int = 128
    fwd_block_n: int = 128
    fwd_block_k: int = 64
    fwd_warps: int = 8
    fwd_stages: int = 3
    dx_block_k: int = 128
    dx_block_n: int = 64
    dx_warps: int = 8
    dx_stages: int = 3
    group_m: int = 8
    rank_block: int = 32
    skinny_block_k: int = 64
    skinny_block_m: int = 64  # rows per program of the S / dS kernels (<= block_m)
    add_block_m: int = 64  # in-place LoRA-term kernels of the cuBLAS mode: rows per program
    add_block_n: int = 128  # ... and output columns per program
    add_warps: int = 4
    add_n_blocks: int = 1  # column blocks each add-kernel program sweeps
    split_waves: int = 2  # dA / dB split an adapter's rows until the grid is this many waves
    ds_waves: int = 3  # S / dS split their sums over K / N until their grid holds this many programs per SM
    skinny_warps: int = 4
    skinny_stages: int = 3
    # "cublas": frozen GEMMs through torch (cuBLAS), LoRA terms added in place by Triton;
    # "triton": frozen GEMMs in Triton with the LoRA terms in the same accumulator;
    # "cublas_accumulate": Triton writes the LoRA terms of Y and dX first, cuBLAS accumulates
    # the frozen products onto them (beta = 1): one read of Y and of dX fewer than "cublas".
    gemm: str = "cublas"

    def __post_init__(self) -> None:
        if self.gemm not in GEMM_MODES:
            raise ValueError(f"LoraBlockSizes.gemm={self.gemm!r}; allowed: {GEMM_MODES}")
        for f in dataclasses.fields(self):
            if f.name == "gemm":
                continue
            v = getattr(self, f.name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"LoraBlockSizes.{f.name}={v!r} must be a positive int")
        for name in ("block_m", "fwd_block_n", "fwd_block_k", "dx_block_k", "dx_block_n",
                     "rank_block", "skinny_block_k", "skinny_block_m", "add_block_m",
                     "add_block_n"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(
                    f"LoraBlockSizes.{name}={v} must be a power of two >= 16 (tl.dot's minimum)"
                )
        for name in ("block_m", "skinny_block_m", "add_block_m"):
            if getattr(self, name) < 32:
                raise ValueError(
                    f"LoraBlockSizes.{name}={getattr(self, name)} must be >= 32 (kernels split "
                    "row blocks into even/odd halves of >= 16 rows for tl.dot)"
                )
        if PAD_MULTIPLE % self.block_m:
            raise ValueError(
                f"LoraBlockSizes.block_m={self.block_m} must divide PAD_MULTIPLE={PAD_MULTIPLE}"
            )

    @classmethod
    def from_dict(cls, d: dict) -> "LoraBlockSizes":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown LoraBlockSizes field(s) {unknown}; known: {sorted(known)}")
        return cls(**d)


# Small tiles for the CPU interpreter (TRITON_INTERPRET=1): fewer wasted elements per program.
INTERPRETER_BLOCK_SIZES = LoraBlockSizes(
    block_m=32, fwd_block_n=64, fwd_block_k=32, dx_block_k=64, dx_block_n=32,
    rank_block=16, skinny_block_k=32, skinny_block_m=32, add_block_m=32, add_block_n=32,
    add_n_blocks=2,
    gemm="triton",
)


@functools.lru_cache(maxsize=None)
def _load_table(path: str) -> dict[str, LoraBlockSizes]:
    # Cached read of a file shipped with the package (pure function of its contents).
    p = Path(path)
    if not p.exists():
        return {}
    raw = json.loads(p.read_text())
    return {name: LoraBlockSizes.from_dict(cfg) for name, cfg in raw.get("devices", {}).items()}


def block_sizes_for(device: torch.device) -> LoraBlockSizes:
    """Tuned sizes for ``device``'s GPU model, or the defaults for unknown GPUs and the CPU."""
    if device.type != "cuda":
        return INTERPRETER_BLOCK_SIZES
    name = torch.cuda.get_device_name(device)
    return _load_table(str(_TABLE_PATH)).get(name, LoraBlockSizes())
