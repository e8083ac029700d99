"""Triton kernels for prefix-shared paged attention (imported as batchjob.kernels)."""
