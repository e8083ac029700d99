"""Attention backends of the native engine: torch path, C kernel (CPU), Triton (CUDA)."""
