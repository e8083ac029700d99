"""Every kernel of batchjob, installed as ``batchjob.kernels``; nothing here imports batchjob.

- ``kernels.triton``: Triton kernels for prefix-shared paged attention (CUDA; CPU under
  ``TRITON_INTERPRET=1`` in tests). Importing the package does not import triton.
- ``kernels.cpu``: the C/OpenMP paged-attention kernel, built on first use with gcc.

Host wrappers take tensors and plain integers; the engine's attention backends
(``batchjob.backends.native.attention``) call down into them, never the other way.
See docs/kernels.md.
"""
