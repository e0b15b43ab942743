"""Test-wide setup: Triton kernels run in the interpreter when no GPU is present."""

import os

import torch

# Must be set before any @triton.jit function is created (at import of the kernel modules).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
