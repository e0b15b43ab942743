"""The FP8 number format of the frozen base: e4m3 (``torch.float8_e4m3fn``) and its largest value."""

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn value
