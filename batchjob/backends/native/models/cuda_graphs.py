"""The forward with everything but attention replayed from CUDA graphs (piecewise graphs).

An eager decode step issues ~25 small torch launches per layer outside attention (norms,
projections, RoPE, residual adds, the MLP; ~35 per layer in all, ~1,100 launches per step at
32 layers as docs/design.md counts them); at decode batch sizes the GPU then waits on the host
for half of each step. Attention cannot be captured as it is: its grid and scalar
arguments follow each batch's groups, prefix lengths and prefix split. So the forward is cut
at attention into L + 1 pieces, each captured once per token-count bucket:

    piece 0:  embed, RoPE lookup, layer 0 up to q/k/v
    piece i:  layer i-1 after attention (o_proj, residual, MLP), layer i up to q/k/v
    piece L:  layer L-1 after attention

and a step replays piece i, then launches layer i's KV write and attention eagerly (two
Triton launches) on the real tokens, and so on. A batch of T tokens runs in the smallest
bucket B >= T: its inputs are copied into static buffers, rows T..B-1 are padding (their
results are never read; every row of every piece is independent of the others), and the
logits are taken eagerly from the real rows. Batches above the largest bucket run eagerly.

Every tensor a later piece or the eager attention reads lives in ``StaticBuffers`` (allocated
once, outside the graphs' memory pool), so what a piece allocates is scratch the pool can
reuse in any other piece. The RoPE table is reserved before capture (graphs hold its
address) and the graphs are dropped if it ever has to grow.

``capture=False`` runs the same pieces eagerly on the same padded buffers: the CPU tests of
the cut, the padding and the buckets, and the fallback where CUDA graphs are unavailable.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from batchjob.backends.native.attention.meta import AttentionMetadata
from batchjob.backends.native.models.llama import Attention, DecoderLayer, LlamaForCausalLM


def capture_sizes(max_tokens: int) -> tuple[int, ...]:
    """Token-count buckets up to ``max_tokens``: 1, 2, 4, then every multiple of 8 to 256,
    of 16 to 512, of 32 beyond (padding at most 1/8 of a batch past 8 tokens), with
    ``max_tokens`` itself the last (empty when it is 0: no graphs)."""
    if max_tokens < 0:
        raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")
    sizes = {1, 2, 4}
    sizes.update(range(8, 257, 8))
    sizes.update(range(272, 513, 16))
    sizes.update(range(544, max_tokens + 1, 32))
    return tuple(sorted({s for s in sizes if s <= max_tokens} | ({max_tokens} - {0})))


def bucket_for(sizes: tuple[int, ...], tokens: int) -> int | None:
    """The smallest bucket holding ``tokens`` (> 0), None when none does."""
    at = bisect.bisect_left(sizes, tokens)
    return sizes[at] if tokens > 0 and at < len(sizes) else None


@dataclass(frozen=True)
class StaticBuffers:
    """What crosses a piece boundary, sized for the largest bucket; a bucket of B tokens
    uses rows [:B] of each."""

    input_ids: torch.Tensor  # int64 [B]
    positions: torch.Tensor  # int64 [B]
    h: torch.Tensor  # [B, hidden]: the residual stream
    cos: torch.Tensor  # [B, 1, D/2]
    sin: torch.Tensor
    qkv: torch.Tensor  # [B, q + 2 kv]: one layer's q, k, v (the attention reads its rows)
    o: torch.Tensor  # [B, q]: one layer's attention output

    @classmethod
    def allocate(cls, model: LlamaForCausalLM, attn: Attention, tokens: int) -> StaticBuffers:
        """Zeroed buffers for ``model``, whose layers' attention is shaped as ``attn``."""
        cfg, w = model.cfg, model.embed_tokens.weight

        def zeros(*shape: int, dtype: torch.dtype = w.dtype) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=w.device)

        return cls(
            input_ids=zeros(tokens, dtype=torch.int64),
            positions=zeros(tokens, dtype=torch.int64),
            h=zeros(tokens, cfg.hidden_size),
            cos=zeros(tokens, 1, cfg.head_dim // 2),
            sin=zeros(tokens, 1, cfg.head_dim // 2),
            qkv=zeros(tokens, attn.q_size + 2 * attn.kv_size),
            o=zeros(tokens, attn.q_size),
        )


def decoder_layers(model: LlamaForCausalLM) -> list[DecoderLayer]:
    """The model's layers, typed (``nn.ModuleList`` items are plain modules to mypy)."""
    return [layer for layer in model.layers if isinstance(layer, DecoderLayer)]


class PiecewiseForward:
    """Callable like ``model.forward``; batches of up to ``max_tokens`` tokens run as replayed
    pieces (captured on a bucket's first use), larger ones eagerly."""

    def __init__(
        self, model: LlamaForCausalLM, max_tokens: int, max_position: int, capture: bool = True
    ) -> None:
        if not model.layers:
            raise ValueError("a model without layers has nothing to capture")
        self.model = model
        self.layers = decoder_layers(model)
        self.sizes = capture_sizes(max_tokens)
        self.max_position = max_position  # the RoPE table reserved before capture
        self.capture = capture
        self.static = StaticBuffers.allocate(model, self.layers[0].attn, max(self.sizes, default=1))
        self._pieces: dict[int, list[Callable[[], None]]] = {}
        self._pool = torch.cuda.graph_pool_handle() if capture else None
        self._table: torch.Tensor | None = None  # the RoPE table the graphs were captured on
        self.captured: list[int] = []  # buckets captured, in order (for reports and tests)
        self.capture_s = 0.0  # host seconds spent capturing

    @torch.inference_mode()
    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        logits_index: torch.Tensor,
    ) -> torch.Tensor:
        model, t = self.model, input_ids.shape[0]
        bucket = bucket_for(self.sizes, t)
        bound = meta.max_prefix_len + meta.max_kv_len
        if bucket is None or model.attn_backend is None or bound > self.max_position:
            return model(input_ids, positions, kv_cache, meta, logits_index)
        self._reserve_rope()
        pieces = self._pieces.get(bucket) or self._build(bucket)
        s = self.static
        s.input_ids[:t].copy_(input_ids, non_blocking=True)
        s.positions[:t].copy_(positions, non_blocking=True)
        for i, layer in enumerate(self.layers):
            pieces[i]()
            q, k, v = layer.attn.split(s.qkv[:t])  # the real rows of the static qkv
            layer.attn.attend(q, k, v, kv_cache[i], meta, model.attn_backend, out=s.o[:t])
        pieces[-1]()
        return model.logits(s.h[:t], logits_index)

    def capture_all(self) -> None:
        """Every bucket captured now (as vLLM does at start-up) instead of on first use."""
        self._reserve_rope()
        for bucket in self.sizes:
            if bucket not in self._pieces:
                self._build(bucket)

    def _reserve_rope(self) -> None:
        """The RoPE table holds every position up to ``max_position``; graphs captured on an
        older table are dropped (it only grows, so this happens once)."""
        model = self.model
        model.rope.reserve(self.max_position, model.inv_freq)
        if self._table is not model.rope.cos:
            self._pieces.clear()
            self._table = model.rope.cos

    def _piece(self, bucket: int, i: int) -> Callable[[], None]:
        """Piece ``i`` on the bucket's rows of the static buffers (module docstring)."""
        model, layers, s = self.model, self.layers, self.static
        n = len(layers)
        h, o, qkv = s.h[:bucket], s.o[:bucket], s.qkv[:bucket]
        cos, sin = s.cos[:bucket], s.sin[:bucket]

        def run() -> None:
            delta = None  # the previous layer's MLP output, not yet added to h
            if i == 0:
                h0, c, si = model.embed(s.input_ids[:bucket], s.positions[:bucket])
                h.copy_(h0)
                cos.copy_(c)
                sin.copy_(si)
            else:
                delta = layers[i - 1].post_attention(h, o)
            if i < n:
                layers[i].pre_attention(h, cos, sin, qkv_out=qkv, residual_delta=delta)
            elif delta is not None:
                h.add_(delta)

        return run

    def _build(self, bucket: int) -> list[Callable[[], None]]:
        """The bucket's pieces: eager callables, or the replays of their captured graphs."""
        pieces = [self._piece(bucket, i) for i in range(len(self.layers) + 1)]
        if self.capture:
            pieces = self._capture(pieces)
        self._pieces[bucket] = pieces
        self.captured.append(bucket)
        return pieces

    def _capture(self, pieces: list[Callable[[], None]]) -> list[Callable[[], None]]:
        """Each piece run once on a side stream (cuBLAS picks its kernels and workspace
        outside capture), then captured there into one pool; the static buffers hold garbage
        after this, which the caller overwrites. ``capture_begin`` directly: the
        ``torch.cuda.graph`` context synchronises the device and empties the device and host
        caching allocators around every graph."""
        t0 = time.perf_counter()
        current = torch.cuda.current_stream()
        side = torch.cuda.Stream()
        side.wait_stream(current)
        replays = []
        with torch.cuda.stream(side):
            for run in pieces:
                run()
            for run in pieces:
                graph = torch.cuda.CUDAGraph()
                # thread_local: another thread's CUDA calls (a writer, a profiler) are allowed
                graph.capture_begin(pool=self._pool, capture_error_mode="thread_local")
                try:
                    run()
                finally:
                    graph.capture_end()
                replays.append(graph.replay)
        current.wait_stream(side)
        self.capture_s += time.perf_counter() - t0
        return replays
