"""Llama-family decoder (Llama, Mistral, Qwen2, Qwen3, Granite, SmolLM3, OLMo2, OLMo3, Phi3,
Gemma3) over a flat ragged batch of tokens.

No batch dimension and no padding: ``T`` tokens of many sequences go through every layer
together; attention is the only place that knows about sequences, through
``AttentionMetadata`` and the attention backend (``model.attn_backend``). q/k/v and
gate/up projections are fused into one matmul each at load time (weights concatenated).

Glue done in place: residual adds (``add_``); RMSNorm with torch's fused ``rms_norm`` in
float32 (bit-equal to HF's formula; HF's two roundings kept in bf16/fp16), in bf16 on the CPU
one C pass with the residual add before it fused in (``cpu_glue``): attention's output before
the post-attention norm, and a layer's MLP output before the next layer's input norm (a
layer returns that output instead of adding it); RoPE on q and k
together as one strided view of the qkv output with cos/sin cached per position
(``RopeTable``, bit-equal to HF's); SiLU-mul written into the gate half of the gate_up output,
which the down projection reads in place (torch's strided loops may differ from HF's
contiguous ones in the last bit, as the split views before did).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from batchjob.backends.native.attention.meta import AttentionMetadata
from batchjob.backends.native.models import cpu_glue
from batchjob.backends.native.models.config import ModelConfig
from batchjob.backends.native.models.logits_buffer import LogitsBuffer
from batchjob.backends.native.models.rope import RopeTable, apply_rope_, inv_frequencies


class RMSNorm(nn.Module):
    def __init__(
        self,
        dim: int,
        eps: float,
        dtype: torch.dtype,
        scale_in_float: bool = False,
        offset: float = 0.0,
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim, dtype=dtype), requires_grad=False)
        self.eps = eps
        # OLMo2's order: scale by the weight in float32, then round once (Llama's rounds the
        # normalised x first); the same in float32
        self.scale_in_float = scale_in_float
        # Gemma's: the scale is offset + weight, in float32 (fold_offset, once loaded)
        self.offset = offset

    def fold_offset(self) -> None:
        """The checkpoint's weight w -> float32 offset + w, the scale the norm applies."""
        if self.offset:
            self.weight = nn.Parameter(self.weight.float() + self.offset, requires_grad=False)
            self.offset = 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, self.scale_in_float)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, scale_in_float: bool = False
) -> torch.Tensor:
    """HF's RMSNorm: normalise in float32, round to x's dtype, then scale by ``weight``;
    ``scale_in_float`` (OLMo2's, Gemma's with a float32 weight): scale in float32, then
    round once."""
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)  # one fused op, bit-equal in float32
    if x.dim() == 2:  # one pass in C (bf16 on the CPU), where it applies
        out = cpu_glue.rms_norm_bf16(x, weight, eps, scale_in_float=scale_in_float)
        if out is not None:
            return out
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * xf).to(x.dtype) if scale_in_float else weight * xf.to(x.dtype)


def add_rms_norm_(h: torch.Tensor, delta: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
    """h += delta in place (the residual stream), then ``norm(h)``; one pass in C for bf16 on
    the CPU (vLLM's fused_add_rms_norm), else the two torch steps."""
    out = cpu_glue.rms_norm_bf16(
        h, norm.weight, norm.eps, residual_delta=delta, scale_in_float=norm.scale_in_float
    )
    if out is not None:
        return out
    return norm(h.add_(delta))


def act_mul_(gate_up: torch.Tensor, inter: int, activation: str = "silu") -> torch.Tensor:
    """act(gate) * up written into the gate half of ``gate_up`` [T, 2I] (act: SiLU, or
    Gemma's tanh-approximated GELU); returns that half (a [T, I] view with row stride 2I,
    which the next matmul reads in place)."""
    gate, up = gate_up[:, :inter], gate_up[:, inter:]
    if activation == "gelu_tanh":
        return gate.copy_(F.gelu(gate, approximate="tanh")).mul_(up)
    return F.silu(gate, inplace=True).mul_(up)


class Attention(nn.Module):
    def __init__(
        self, cfg: ModelConfig, dtype: torch.dtype, rope: bool = True, window: int | None = None
    ) -> None:
        super().__init__()
        self.rope = rope  # False: a layer without positional rotation (SmolLM3's NoPE layers)
        self.window = window  # sliding window (a query sees the last W positions), or None
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
        )
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.scale = cfg.attention_scale
        self.rotary_dims = cfg.rotary_dims  # < head_dim: Phi3's partial rotary
        out = self.q_size + 2 * self.kv_size
        self.qkv = nn.Linear(cfg.hidden_size, out, bias=cfg.qkv_bias, dtype=dtype)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=cfg.o_bias, dtype=dtype)
        # q/k norms: per head (Qwen3, Gemma3), or over the whole projection (OLMo2)
        self.qk_norm_whole = cfg.qk_norm_whole
        q_dim, k_dim = (self.q_size, self.kv_size) if cfg.qk_norm_whole else (cfg.head_dim,) * 2
        eps, in_float, off = cfg.rms_norm_eps, cfg.branch_norms, cfg.norm_offset
        self.q_norm = RMSNorm(q_dim, eps, dtype, in_float, off) if cfg.qk_norm else None
        self.k_norm = RMSNorm(k_dim, eps, dtype, in_float, off) if cfg.qk_norm else None

    def project(
        self,
        x: torch.Tensor,  # [T, hidden]
        cos: torch.Tensor,  # [T, 1, D/2]
        sin: torch.Tensor,
        qkv_out: torch.Tensor | None = None,  # [T, q + 2 kv]: where q, k, v are kept
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [T, H, D], k and v [T, Hkv, D]: views of one qkv tensor (``qkv_out`` if given,
        which CUDA graphs need), q and k normalised (Qwen3) and rotated (but in NoPE layers)
        in place."""
        qkv = self.qkv(x)  # [T, q + 2 kv]
        if qkv_out is not None:
            qkv = qkv_out.copy_(qkv)
        q, k, v = self.split(qkv)
        qk_end = self.q_size + self.kv_size
        if self.q_norm is not None and self.k_norm is not None:  # written back in place
            if self.qk_norm_whole:
                q_all, k_all = qkv[:, : self.q_size], qkv[:, self.q_size : qk_end]
                q_all.copy_(self.q_norm(q_all))
                k_all.copy_(self.k_norm(k_all))
            else:
                q.copy_(self.q_norm(q))
                k.copy_(self.k_norm(k))
        if self.rope:
            qk = qkv[:, :qk_end].view(len(qkv), self.num_heads + self.num_kv_heads, self.head_dim)
            if self.rotary_dims < self.head_dim:  # the rest of each head passes through
                qk = qk[..., : self.rotary_dims]
            apply_rope_(qk, cos, sin)  # q and k rotated together, in place
        return q, k, v

    def split(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [T, H, D], k and v [T, Hkv, D]: views of a qkv projection [T, q + 2 kv]."""
        t, d, qk_end = qkv.shape[0], self.head_dim, self.q_size + self.kv_size
        return (
            qkv[:, : self.q_size].view(t, self.num_heads, d),
            qkv[:, self.q_size : qk_end].view(t, self.num_kv_heads, d),
            qkv[:, qk_end:].view(t, self.num_kv_heads, d),
        )

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
        meta: AttentionMetadata,
        backend,
        out: torch.Tensor | None = None,  # [T, q_size]
    ) -> torch.Tensor:
        """Writes k, v to the cache, then attention: [T, q_size] (``out`` when given)."""
        t = q.shape[0]
        k_cache, v_cache = layer_cache[0], layer_cache[1]
        backend.write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
        o_out = None if out is None else out.view(t, self.num_heads, self.head_dim)
        w = self.window
        o = backend.attend(q, k_cache, v_cache, meta, self.scale, out=o_out, window=w)  # [T,H,D]
        return o.reshape(t, self.q_size)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.inter = cfg.intermediate_size
        self.activation = cfg.activation
        self.gate_up = nn.Linear(cfg.hidden_size, 2 * self.inter, bias=cfg.mlp_bias, dtype=dtype)
        self.down = nn.Linear(self.inter, cfg.hidden_size, bias=cfg.mlp_bias, dtype=dtype)
        # x -> act(gate) * up in one module (onednn_linear.OneDnnActMul on bf16 CPUs)
        self.fused_gate_up: nn.Module | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused_gate_up is not None and x.dim() == 2:
            return self.down(self.fused_gate_up(x))
        return self.down(act_mul_(self.gate_up(x), self.inter, self.activation))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, index: int = 0) -> None:
        super().__init__()
        hidden, eps, branch = cfg.hidden_size, cfg.rms_norm_eps, cfg.branch_norms
        off = cfg.norm_offset

        def norm() -> RMSNorm:  # branch norms scale in float32 (OLMo2, Gemma3)
            return RMSNorm(hidden, eps, dtype, scale_in_float=branch, offset=off)

        # Llama: input_norm before attention, post_norm before the MLP. Branch norms: post_norm
        # on attention's output, post_ff_norm on the MLP's; OLMo2 without input norms, Gemma3
        # with both (input_norm, pre_ff_norm)
        self.input_norm = norm() if cfg.input_norms else None
        self.attn = Attention(cfg, dtype, rope=cfg.uses_rope(index), window=cfg.layer_window(index))
        self.post_norm = norm()
        self.pre_ff_norm = norm() if branch and cfg.input_norms else None
        self.post_ff_norm = norm() if branch else None
        self.mlp = MLP(cfg, dtype)
        self.residual_multiplier = cfg.residual_multiplier  # Granite's; 1 elsewhere

    def _scaled(self, branch: torch.Tensor) -> torch.Tensor:
        """A branch's output as the residual stream adds it (Granite scales it first, in
        the model's dtype as HF does)."""
        m = self.residual_multiplier
        return branch if m == 1.0 else branch.mul_(m)

    def pre_attention(self, h, cos, sin, qkv_out=None, residual_delta=None):
        """q, k, v of the normalised residual stream h [T, hidden] (``Attention.project``);
        with ``residual_delta`` (the previous layer's MLP output) h += it first, in the
        norm's pass (vLLM's fused_add_rms_norm at a layer's input)."""
        if self.input_norm is None:  # OLMo2: attention reads the residual stream itself
            x = h if residual_delta is None else h.add_(residual_delta)
        elif residual_delta is None:
            x = self.input_norm(h)
        else:
            x = add_rms_norm_(h, residual_delta, self.input_norm)
        return self.attn.project(x, cos, sin, qkv_out)

    def post_attention(self, h: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        """h [T, hidden] (the residual stream) updated in place with attention's output o
        [T, q_size]; returns the MLP's output, which the caller adds to h: the next layer's
        ``pre_attention`` in its norm's pass, or ``h.add_`` after the last layer."""
        attn_out = self._scaled(self.attn.o_proj(o))
        if self.post_ff_norm is not None and self.pre_ff_norm is not None:  # Gemma3
            x = add_rms_norm_(h, self.post_norm(attn_out), self.pre_ff_norm)
            return self.post_ff_norm(self.mlp(x))
        if self.post_ff_norm is not None:  # OLMo2: each branch normalised, then added
            h.add_(self.post_norm(attn_out))
            return self.post_ff_norm(self.mlp(h))
        return self._scaled(self.mlp(add_rms_norm_(h, attn_out, self.post_norm)))

    def forward(self, h, cos, sin, layer_cache, meta, backend, residual_delta=None):
        """The MLP output still to be added to h (``post_attention``)."""
        q, k, v = self.pre_attention(h, cos, sin, residual_delta=residual_delta)
        return self.post_attention(h, self.attn.attend(q, k, v, layer_cache, meta, backend))


class LlamaForCausalLM(nn.Module):
    """One class for all supported families; ``cfg`` flags select the differences."""

    inv_freq: torch.Tensor  # a registered buffer (nn.Module types buffers as Tensor | Module)
    sliding_inv_freq: torch.Tensor | None  # Gemma3's windowed layers' (a buffer), else None

    def __init__(
        self, cfg: ModelConfig, dtype: torch.dtype, attn_backend=None, long_rope: bool = False
    ) -> None:
        """``long_rope``: longrope's long factors (``ModelConfig.long_rope``)."""
        super().__init__()
        self.cfg = cfg
        # _weight skips the random init (normal_ on meta would import torch._dynamo: ~8 s)
        weight = torch.empty(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, _weight=weight)
        self.layers = nn.ModuleList(DecoderLayer(cfg, dtype, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(
            cfg.hidden_size, cfg.rms_norm_eps, dtype, cfg.branch_norms, cfg.norm_offset
        )
        self.lm_head = (
            None
            if cfg.tie_word_embeddings
            else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False, dtype=dtype)
        )
        # on CPU even under a meta context
        inv_freq = inv_frequencies(cfg.rope, cfg.rotary_dims, long_rope)
        self.register_buffer("inv_freq", inv_freq, persistent=False)  # float32 [D/2]
        # cos/sin per position, filled on first use
        self.rope = RopeTable(dtype, scale=cfg.rope.attention_factor)
        # Gemma3's windowed layers: a RoPE of their own (table 1 of ``layer_tables``)
        self.sliding_rope: RopeTable | None = None
        local = (
            None if cfg.sliding_rope is None else inv_frequencies(cfg.sliding_rope, cfg.rotary_dims)
        )
        self.register_buffer("sliding_inv_freq", local, persistent=False)  # float32 [D/2] | None
        if cfg.sliding_rope is not None:
            self.sliding_rope = RopeTable(dtype, scale=cfg.sliding_rope.attention_factor)
        # per layer: the table of its RoPE (0: ``rope``, 1: ``sliding_rope``)
        self.layer_tables = [int(cfg.layer_rope(i) is not cfg.rope) for i in range(cfg.num_layers)]
        self.attn_backend = attn_backend  # write_kv/attend provider, see engine.attention
        # the logits projection as a module (cpu_linear.PackedLinear), else F.linear below
        self.logits_linear: nn.Module | None = None
        # set by the engine on CPUs: float32 logits into storage reused step to step
        self.logits_buffer: LogitsBuffer | None = None

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # int64 [T]
        positions: torch.Tensor,  # int64 [T]: absolute position (group prefix included)
        kv_cache: torch.Tensor,  # [L, 2, num_blocks, block_size, Hkv, D]
        meta: AttentionMetadata,
        logits_index: torch.Tensor,  # int64 [K]: token indices that need logits
    ) -> torch.Tensor:  # float32 [K, vocab]
        return self.logits(self.last_hidden(input_ids, positions, kv_cache, meta), logits_index)

    @torch.inference_mode()
    def last_hidden(
        self,
        input_ids: torch.Tensor,  # int64 [T]
        positions: torch.Tensor,  # int64 [T]
        kv_cache: torch.Tensor,  # [L, 2, num_blocks, block_size, Hkv, D]
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, hidden]: the last layer's residual stream, before the final norm
        if self.attn_backend is None:
            raise RuntimeError("model.attn_backend is not set")
        # every position < its group's prefix + its own KV (build_batch checks it)
        bound = meta.max_prefix_len + meta.max_kv_len
        h, cos, sin = self.embed(input_ids, positions, bound)
        tables = [(cos, sin)]
        if self.sliding_rope is not None and self.sliding_inv_freq is not None:
            tables.append(self.sliding_rope.lookup(positions, self.sliding_inv_freq, bound))
        delta = None  # a layer's MLP output, added to h in the next layer's input norm
        for i, layer in enumerate(self.layers):
            c, s = tables[self.layer_tables[i]]
            delta = layer(h, c, s, kv_cache[i], meta, self.attn_backend, delta)
        return h if delta is None else h.add_(delta)

    def fold_norm_offsets(self) -> None:
        """Gemma3's norms scale by 1 + weight: folded into float32 weights once loaded."""
        for m in self.modules():
            if isinstance(m, RMSNorm):
                m.fold_offset()

    def embed(
        self, input_ids: torch.Tensor, positions: torch.Tensor, bound: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The residual stream h [T, hidden] (a fresh tensor, updated in place by the layers)
        and RoPE's cos, sin [T, 1, D/2]; ``bound``: every position is below it (0: the table
        already holds every position)."""
        cos, sin = self.rope.lookup(positions, self.inv_freq, bound)
        h = self.embed_tokens(input_ids)
        m = self.cfg.embedding_multiplier  # Granite's, Gemma3's sqrt(hidden); 1 elsewhere
        if m != 1.0 and self.cfg.embedding_scale_in_dtype:  # Gemma3: rounded to the dtype
            m = float(torch.tensor(m, dtype=h.dtype))
        return (h if m == 1.0 else h.mul_(m)), cos, sin

    def logits(self, h: torch.Tensor, logits_index: torch.Tensor) -> torch.Tensor:
        """float32 [K, vocab] of the rows ``logits_index`` of the last layer's h; with
        ``logits_buffer`` set, a view of its storage valid until the next call."""
        x = self.norm(h[logits_index])  # [K, hidden]
        if self.logits_linear is not None:
            y = self.logits_linear(x)
        else:
            y = F.linear(x, self.logits_weight())  # [K, vocab]
        out = y.float() if self.logits_buffer is None else self.logits_buffer.to_float(y)
        s = self.cfg.logits_scaling  # Granite's; 1 elsewhere (divided in float32)
        return out if s == 1.0 else out.div_(s)

    def logits_weight(self) -> torch.Tensor:
        """[vocab, hidden]: the untied head's, else the embedding's."""
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def checkpoint_sources(self) -> dict[str, list[str]]:
        """Parameter name -> checkpoint tensor names, concatenated along dim 0 when several."""
        src: dict[str, list[str]] = {
            "embed_tokens.weight": ["model.embed_tokens.weight"],
            "norm.weight": ["model.norm.weight"],
        }
        if self.lm_head is not None:
            src["lm_head.weight"] = ["lm_head.weight"]
        # Phi3's checkpoints fuse q/k/v and gate/up too
        phi3 = self.cfg.architecture == "Phi3ForCausalLM"
        qkv_names: tuple[str, ...] = ("qkv",) if phi3 else ("q", "k", "v")
        gate_up_names: tuple[str, ...] = ("gate_up",) if phi3 else ("gate", "up")
        for i in range(self.cfg.num_layers):
            hf, me = f"model.layers.{i}.", f"layers.{i}."
            src[me + "input_norm.weight"] = [hf + "input_layernorm.weight"]
            src[me + "post_norm.weight"] = [hf + "post_attention_layernorm.weight"]
            src[me + "pre_ff_norm.weight"] = [hf + "pre_feedforward_layernorm.weight"]
            src[me + "post_ff_norm.weight"] = [hf + "post_feedforward_layernorm.weight"]
            for kind in ("weight", "bias"):
                qkv = [f"{hf}self_attn.{p}_proj.{kind}" for p in qkv_names]
                src[f"{me}attn.qkv.{kind}"] = qkv
                src[f"{me}attn.o_proj.{kind}"] = [f"{hf}self_attn.o_proj.{kind}"]
                gate_up = [f"{hf}mlp.{p}_proj.{kind}" for p in gate_up_names]
                src[f"{me}mlp.gate_up.{kind}"] = gate_up
                src[f"{me}mlp.down.{kind}"] = [f"{hf}mlp.down_proj.{kind}"]
            src[me + "attn.q_norm.weight"] = [hf + "self_attn.q_norm.weight"]
            src[me + "attn.k_norm.weight"] = [hf + "self_attn.k_norm.weight"]
        names = dict(self.named_parameters())
        return {k: v for k, v in src.items() if k in names}
