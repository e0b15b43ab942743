"""Kernel tests run the Triton kernels in the interpreter on the CPU when no GPU is present."""

import os

import pytest
import torch

# The interpreter flag must be set before triton.jit decorates the kernels (at their import).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")
