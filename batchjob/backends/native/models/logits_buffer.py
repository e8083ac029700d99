"""float32 logits written into one buffer kept across engine steps (CPU, half-precision models).

A bf16 model's logits projection returns bf16 [K, vocab]; the sampler reads float32. At a
150k-token vocabulary a decode step of 150 rows is 91 MB of float32 logits: above glibc's
largest mmap threshold (32 MiB, see ``malloc_tuning``), so ``.float()`` maps fresh pages every
step and faults them in 4 KiB at a time. On an AMX Xeon (Qwen2.5-0.5B's head, 2 threads) the
conversion into a fresh tensor cost 23 ms at 150 rows and 91 ms at 300 over a 70 / 137 ms
projection; into a buffer kept from the last step, 6 / 9 ms. The widening is exact, so the
values are those of ``.float()``.

The tensor returned is a view of the buffer, valid until the next call: the engine consumes
each step's logits before it runs the next forward. Callers that keep logits across forwards
(tests, the Python API's scoring of two batches) leave ``LlamaForCausalLM.logits_buffer``
unset and get fresh tensors.
"""

from __future__ import annotations

import torch

MAX_BYTES = 512 << 20  # larger logits (many prompt-logprob rows) take a fresh tensor


class LogitsBuffer:
    """Widens [K, vocab] logits to float32 into storage reused from call to call."""

    def __init__(self, max_bytes: int = MAX_BYTES) -> None:
        self.max_bytes = max_bytes
        self._buf: torch.Tensor | None = None

    def to_float(self, y: torch.Tensor) -> torch.Tensor:
        """``y.float()``: a view of the buffer for 2-D half-precision CPU logits that fit it."""
        if y.dtype == torch.float32 or y.device.type != "cpu" or y.dim() != 2:
            return y.float()
        rows, cols = y.shape
        if rows * cols * 4 > self.max_bytes or cols == 0:
            return y.float()
        buf = self._buf
        if buf is None or buf.shape[1] != cols or buf.shape[0] < rows:
            held = buf.shape[0] if buf is not None and buf.shape[1] == cols else 0
            cap = min(max(rows, 2 * held), self.max_bytes // (cols * 4))  # grow by doubling
            self._buf = buf = torch.empty(cap, cols, dtype=torch.float32)
        return buf[:rows].copy_(y)
