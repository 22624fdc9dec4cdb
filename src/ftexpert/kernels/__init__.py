"""Triton kernels, each with a plain PyTorch reference beside it."""
