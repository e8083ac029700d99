"""The CPU paged-attention kernel (paged_attention.c), compiled on first use (``build``)."""
