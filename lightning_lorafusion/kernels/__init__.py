"""Fused LoRA kernels (Triton), their torch references and autograd wrappers."""
