"""Rotary position embedding (neox / ``rotate_half`` layout, as in HF Llama checkpoints)."""

from __future__ import annotations

import math

import torch

from batchjob.backends.native.models.config import RopeConfig
from batchjob.backends.native.models.cpu_glue import c_library  # any ISA build: the same bits

_C_DTYPES = (torch.float32, torch.bfloat16)


def inv_frequencies(rope: RopeConfig, dims: int, long: bool = False) -> torch.Tensor:
    """float32 [dims/2] on CPU: inverse frequencies of the ``dims`` rotated dims of a head,
    with linear, llama3 or longrope scaling applied (``long``: longrope's long factors)."""
    exponent = torch.arange(0, dims, 2, dtype=torch.int64, device="cpu").float() / dims
    if rope.rope_type == "longrope":  # transformers' order: 1 / (factor * theta^e)
        factors = torch.tensor(rope.long_factor if long else rope.short_factor, device="cpu")
        return 1.0 / (factors * rope.theta**exponent)
    inv_freq = 1.0 / (rope.theta**exponent)
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "llama3":
        low_wavelen = rope.original_max_position / rope.low_freq_factor
        high_wavelen = rope.original_max_position / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (rope.original_max_position / wavelen - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled)
    return inv_freq


def rope_cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype, scale: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """positions: [T] -> cos, sin: [T, 1, D] in ``dtype`` (angles computed in float32;
    ``scale``, longrope's attention factor, multiplies both in float32 before the rounding)."""
    freqs = positions[:, None].float() * inv_freq[None, :]  # [T, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]  # [T, 1, D]
    cos, sin = emb.cos(), emb.sin()
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    return cos.to(dtype), sin.to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, H, D]; cos, sin: [T, 1, D] -> [T, H, D] (out of place, HF's formula)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class RopeTable:
    """cos/sin of every position up to the largest seen, cached in the model's dtype.

    Built from the same float32 products as ``rope_cos_sin`` (position * inv_freq, times
    ``scale``), so a row of the table is bit-equal to computing it per call with the same
    scale; grows by doubling. ``scale`` (longrope's attention factor) multiplies cos and sin
    in float32 before the rounding, as transformers and vLLM do.
    """

    def __init__(self, dtype: torch.dtype, scale: float = 1.0) -> None:
        self.dtype = dtype
        self.scale = scale
        self.cos = self.sin = torch.empty(0, 0, dtype=dtype, device="cpu")  # [P, D/2]

    def lookup(
        self, positions: torch.Tensor, inv_freq: torch.Tensor, bound: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: int64 [T] -> cos, sin: [T, 1, D/2] (the half both rotations share).

        ``bound``: every position is below it, known on the host; without it the
        largest position is read from the tensor, which on a GPU waits for the stream.
        """
        if bound is None:
            bound = int(positions.max()) + 1 if positions.numel() else 0
        self.reserve(bound, inv_freq)
        return self.cos[positions][:, None, :], self.sin[positions][:, None, :]

    def reserve(self, bound: int, inv_freq: torch.Tensor) -> None:
        """The table holds every position below ``bound`` on ``inv_freq``'s device (rebuilt,
        at least doubled, when it does not: a new tensor)."""
        stale = self.cos.device != inv_freq.device or self.cos.shape[1] != inv_freq.shape[0]
        if bound > self.cos.shape[0] or stale:
            size = max(bound, 2 * self.cos.shape[0], 256)
            pos = torch.arange(size, dtype=torch.int64, device=inv_freq.device).float()
            freqs = pos[:, None] * inv_freq[None, :]  # [P, D/2] float32
            cos, sin = freqs.cos(), freqs.sin()
            if self.scale != 1.0:
                cos, sin = cos * self.scale, sin * self.scale
            self.cos, self.sin = cos.to(self.dtype), sin.to(self.dtype)


def apply_rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate x in place: x [T, H, D] (a strided view is fine, e.g. q and k of the fused
    qkv output as one [T, H + Hkv, D] view, or its leading D dims of each head where RoPE
    rotates part of it); cos, sin: [T, 1, D/2] from ``RopeTable``.

    Bit-equal to ``apply_rope``: the first half is x1*cos - x2*sin (HF: x1*cos + (-x2)*sin),
    the second x2*cos + x1*sin, each product rounded before the sum (no fused multiply-add).
    """
    kn = c_library() if x.device.type == "cpu" and x.dtype in _C_DTYPES else None
    if (
        kn is not None
        and x.stride(-1) == 1
        and cos.dtype == sin.dtype == x.dtype
        and cos.is_contiguous()
        and sin.is_contiguous()
        and x.numel()
    ):  # one pass in C (rope.c), bit-equal to the ops below: ~8x faster on the CPU
        t, h, d = x.shape
        rc = kn.rope(
            x.data_ptr(), t, h, d, x.stride(0), x.stride(1), cos.data_ptr(), sin.data_ptr(),
            int(x.dtype == torch.bfloat16), torch.get_num_threads(),
        )  # fmt: skip
        if rc == 0:
            return
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    first = x1 * cos
    first.sub_(x2 * sin)
    x2.mul_(cos).add_(x1 * sin)
    x1.copy_(first)
