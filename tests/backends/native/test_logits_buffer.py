"""float32 logits widened into a buffer kept across steps: the values of ``.float()``."""

from __future__ import annotations

import torch

from batchjob.backends.native.models.logits_buffer import LogitsBuffer


def test_widening_equals_float_and_reuses_storage() -> None:
    g = torch.Generator().manual_seed(0)
    buf = LogitsBuffer()
    a = torch.randn(7, 300, generator=g).bfloat16()
    out_a = buf.to_float(a)
    assert out_a.dtype == torch.float32 and torch.equal(out_a, a.float())
    ptr = out_a.data_ptr()
    b = torch.randn(5, 300, generator=g).bfloat16()  # fewer rows: the same storage
    out_b = buf.to_float(b)
    assert torch.equal(out_b, b.float()) and out_b.data_ptr() == ptr
    c = torch.randn(20, 300, generator=g).bfloat16()  # more rows: a larger buffer, then kept
    out_c = buf.to_float(c)
    assert torch.equal(out_c, c.float())
    assert buf.to_float(c[:3]).data_ptr() == out_c.data_ptr()


def test_what_the_buffer_does_not_take_gets_a_fresh_tensor() -> None:
    buf = LogitsBuffer(max_bytes=1000)
    big = torch.randn(10, 100).bfloat16()  # 4,000 bytes of float32: over the cap
    out = buf.to_float(big)
    assert torch.equal(out, big.float()) and buf.to_float(big).data_ptr() != out.data_ptr()
    f32 = torch.randn(2, 3)
    assert buf.to_float(f32) is f32  # already float32: as .float() does
    x3 = torch.randn(2, 2, 3).bfloat16()
    assert torch.equal(buf.to_float(x3), x3.float())


def test_a_vocabulary_change_replaces_the_buffer() -> None:
    buf = LogitsBuffer()
    a = buf.to_float(torch.ones(4, 10, dtype=torch.bfloat16))
    b = buf.to_float(torch.full((4, 12), 2.0, dtype=torch.bfloat16))
    assert a.shape == (4, 10) and b.shape == (4, 12) and bool((b == 2).all())
