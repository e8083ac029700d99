"""Parse a Hugging Face ``config.json`` (+ ``generation_config.json``) dict into a typed config.

Torch-free and I/O-free: ``batchjob.model.info`` reads the files once and calls
``parse_hf_config``. One parser for the whole Llama family; the differences between
families are flags: q/k/v bias (Qwen2; Llama/Qwen3 ``attention_bias``), per-head q/k
RMSNorm (Qwen3), sliding windows (Mistral, Phi3; Qwen with ``use_sliding_window``; per
layer where ``layer_types`` says), layers without
RoPE (SmolLM3's ``no_rope_layers``), Granite's four scalars (embedding, residual and
attention multipliers, logits scaling), and OLMo2's norms on the branch outputs instead of
their inputs, with q/k RMSNorm over the whole projection (OLMo3: the same, with sliding
windows), Phi3's RoPE over part of each head (``partial_rotary_factor``) with longrope's
short and long factor sets (its fused qkv and gate_up tensors are the loader's concern), and
Gemma3's norms around both branches scaling by 1 + weight, tanh-GELU, a RoPE per layer type
and the embedding scaled by sqrt(hidden). Both the legacy ``rope_theta`` + ``rope_scaling``
keys and the transformers-5 ``rope_parameters`` dict (flat, or keyed by layer type) are
understood. Anything the native
engine cannot run raises ``ModelError`` here, so that ``batchjob plan`` refuses the same
model folders as ``batchjob run``.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from batchjob.errors import ModelError

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "GraniteForCausalLM",
    "SmolLM3ForCausalLM",
    "Olmo2ForCausalLM",
    "Olmo3ForCausalLM",
    "Phi3ForCausalLM",
    "Gemma3ForCausalLM",
    "Gemma3ForConditionalGeneration",  # its language model (text prompts)
)
_GEMMA3 = ("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration")
_OLMO = ("Olmo2ForCausalLM", "Olmo3ForCausalLM")  # OLMo3: OLMo2's layers, sliding windows
# where config.json's attention_bias puts no bias on o_proj (Qwen2: on q, k, v; Mistral: none),
# and the families whose mlp_bias puts biases on the MLP
_NO_O_BIAS = ("MistralForCausalLM", "Qwen2ForCausalLM")
_MLP_BIAS = ("LlamaForCausalLM", "GraniteForCausalLM", "SmolLM3ForCausalLM")
# the families whose config.json sliding_window always applies (the others: when enabled)
_WINDOWED = (
    "MistralForCausalLM",
    "Phi3ForCausalLM",
    "Gemma3ForCausalLM",
    "Gemma3ForConditionalGeneration",
)
# the families that rotate only the first partial_rotary_factor of each head (HF slices)
_PARTIAL_ROTARY = ("Phi3ForCausalLM",)
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope")
# the MLP's activation (config.json hidden_act / Gemma's hidden_activation) -> its name here
ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}


@dataclass(frozen=True)
class RopeConfig:
    theta: float
    rope_type: str  # one of SUPPORTED_ROPE_TYPES
    factor: float = 1.0  # linear, llama3
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    original_max_position: int = 8192  # llama3, longrope
    # longrope (Phi-3.5, Phi-4-mini): per-frequency divisors, the short set for contexts up to
    # original_max_position, the long one beyond; cos and sin scaled by attention_factor
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    attention_factor: float = 1.0


@dataclass(frozen=True)
class ModelConfig:
    """The architecture as config.json describes it (not the job's ``[model]`` section)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position: int
    tie_word_embeddings: bool
    qkv_bias: bool  # bias on q/k/v projections
    o_bias: bool  # bias on the output projection
    mlp_bias: bool
    qk_norm: bool  # RMSNorm on q and k before RoPE: over head_dim (Qwen3), or all (OLMo2)
    # attention window (HF's: a query sees the keys of the last W positions, itself
    # included); None = full attention
    sliding_window: int | None
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    torch_dtype: str | None  # the checkpoint's dtype name ("bfloat16"), if given
    rope_layers: tuple[bool, ...] | None = None  # per layer: RoPE applied (None: every layer)
    embedding_multiplier: float = 1.0  # Granite: the embedding output scaled by it
    residual_multiplier: float = 1.0  # Granite: each layer's attention and MLP outputs
    attention_multiplier: float | None = None  # Granite: the softmax scale (None: D^-0.5)
    logits_scaling: float = 1.0  # Granite: the logits divided by it
    # OLMo2: no norm before attention and MLP, one on each branch's output before its
    # residual add; q/k norms over the whole projection; norms scale in float32 then round
    branch_norms: bool = False
    rotary_dim: int = 0  # the leading dims of each head RoPE rotates (0: all; Phi3's partial)
    window_layers: tuple[bool, ...] | None = None  # per layer: windowed (None: every layer)
    sliding_rope: RopeConfig | None = None  # the windowed layers' RoPE, where it differs
    activation: str = "silu"  # a value of ACTIVATIONS: the gate's, times up
    # Gemma3: a norm before each branch too (with branch_norms), every norm scaling by
    # 1 + weight (in float32: norm_offset 1), the embedding scale rounded to the model's dtype
    input_norms: bool = True
    norm_offset: float = 0.0
    embedding_scale_in_dtype: bool = False
    qk_norm_whole: bool = False  # q/k RMSNorm over the whole projection (OLMo2), not per head

    @property
    def rotary_dims(self) -> int:
        """How many of a head's dims RoPE rotates (the rest pass through)."""
        return self.rotary_dim or self.head_dim

    def long_rope(self, max_model_len: int) -> bool:
        """longrope's long factors: for contexts beyond the original one (vLLM's rule, by
        the context the engine is set up for; HF decides per forward by its length)."""
        rope = self.rope
        return rope.rope_type == "longrope" and max_model_len > rope.original_max_position

    @property
    def attention_scale(self) -> float:
        """The scale of q.k in attention's softmax."""
        m = self.attention_multiplier
        return self.head_dim**-0.5 if m is None else m

    def uses_rope(self, layer: int) -> bool:
        return self.rope_layers is None or self.rope_layers[layer]

    @property
    def max_seq_len(self) -> int:
        """The longest prefix + prompt + output the model runs: max_position_embeddings."""
        return self.max_position

    def layer_rope(self, layer: int) -> RopeConfig:
        """The RoPE of ``layer``: Gemma3's windowed layers have their own."""
        local = self.sliding_rope is not None and self.layer_window(layer) is not None
        return self.sliding_rope if local and self.sliding_rope is not None else self.rope

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of ``layer``'s attention; None: it sees every earlier key."""
        w, per_layer = self.sliding_window, self.window_layers
        return w if per_layer is None or per_layer[layer] else None


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def _optional(cfg: dict[str, Any], key: str, default: Any) -> Any:
    """``cfg[key]``, or ``default`` when the key is absent or null (0 stays 0: refused)."""
    value = cfg.get(key)
    return default if value is None else value


def _per_layer_type(params: dict[str, Any], source: Path) -> dict[str, Any]:
    """transformers-5 ``rope_parameters`` keyed by layer type (``{"full_attention": {...},
    "sliding_attention": {...}}``, OLMo3's) -> the one set they share; ModelError where they
    differ (one RoPE for every layer is what the engine runs)."""
    if not params or not all(isinstance(v, dict) for v in params.values()):
        return params  # the flat form
    distinct = {json.dumps(v, sort_keys=True) for v in params.values()}
    if len(distinct) > 1:
        raise ModelError(
            f"{source}: rope_parameters differ by layer type ({', '.join(sorted(params))}); "
            "the native engine runs one RoPE for every layer"
        )
    return dict(next(iter(params.values())))


def _rope_scaling(cfg: dict[str, Any], source: Path) -> dict[str, Any]:
    """The rope settings as one dict: transformers-5 ``rope_parameters`` over the legacy
    ``rope_scaling``."""
    params = cfg.get("rope_parameters")
    legacy = cfg.get("rope_scaling")
    scaling: dict[str, Any] = {}
    if isinstance(params, dict):
        scaling = _per_layer_type(dict(params), source)
    if isinstance(legacy, dict):
        scaling = {**legacy, **scaling}
    return scaling


def _partial_rotary_factor(cfg: dict[str, Any], source: Path, arch: str) -> float:
    """``partial_rotary_factor`` from the rope settings or the top level (Phi-4-mini's)."""
    settings = _gemma3_rope_settings(cfg)[0] if arch in _GEMMA3 else _rope_scaling(cfg, source)
    value = settings.get("partial_rotary_factor")
    value = _optional(cfg, "partial_rotary_factor", 1.0) if value is None else value
    try:
        factor = float(value)
    except (TypeError, ValueError) as e:
        raise ModelError(f"{source}: partial_rotary_factor is not a number: {value!r}") from e
    if not 0 < factor <= 1:
        raise ModelError(f"{source}: partial_rotary_factor is {factor}; it must be in (0, 1]")
    return factor


def _parse_rope(cfg: dict[str, Any], source: Path, arch: str = "") -> RopeConfig:
    if arch in _GEMMA3:
        return _rope_of(_gemma3_rope_settings(cfg)[0], cfg, source, arch)
    return _rope_of(_rope_scaling(cfg, source), cfg, source, arch)


def _gemma3_rope_settings(cfg: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Gemma3's RoPE settings of its full and its sliding-window layers, as transformers'
    Gemma3TextConfig reads them: ``rope_parameters`` keyed by layer type, or the legacy
    ``rope_theta`` (full, default 1e6) with ``rope_scaling``, and ``rope_local_base_freq``
    (sliding, default 10,000)."""
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and "full_attention" in params:
        full, local = params.get("full_attention") or {}, params.get("sliding_attention") or {}
    else:
        full, local = dict(cfg.get("rope_scaling") or {}), {}
    full = {"rope_theta": _optional(cfg, "rope_theta", 1_000_000.0), **full}
    local = {"rope_theta": _optional(cfg, "rope_local_base_freq", 10_000.0), **local}
    return full, local


def _rope_of(scaling: dict[str, Any], cfg: dict[str, Any], source: Path, arch: str) -> RopeConfig:
    """One rope settings dict (``rope_type`` / ``type``, ``rope_theta``, the type's keys)."""
    theta = float(scaling.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    rope_type = scaling.get("rope_type", scaling.get("type", "default")) or "default"
    if arch == "Phi3ForCausalLM" and rope_type in ("su", "yarn"):
        rope_type = "longrope"  # Phi3's legacy names (transformers' Phi3Config maps them)
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelError(
            f"{source}: rope scaling type {rope_type!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
        )
    if rope_type == "default":
        return RopeConfig(theta=theta, rope_type="default")
    try:
        if rope_type == "longrope":
            return _longrope(cfg, scaling, theta, source)
        factor = float(scaling["factor"])
        if rope_type == "linear":
            return RopeConfig(theta=theta, rope_type="linear", factor=factor)
        return RopeConfig(
            theta=theta,
            rope_type="llama3",
            factor=factor,
            low_freq_factor=float(scaling["low_freq_factor"]),
            high_freq_factor=float(scaling["high_freq_factor"]),
            original_max_position=int(scaling["original_max_position_embeddings"]),
        )
    except KeyError as e:
        raise ModelError(f"{source}: rope scaling {rope_type!r} lacks key {e.args[0]!r}") from e


def _longrope(
    cfg: dict[str, Any], scaling: dict[str, Any], theta: float, source: Path
) -> RopeConfig:
    """LongRoPE as transformers computes it: the original context from the top level (Phi3
    keeps it there) or the rope settings, else max_position_embeddings; the cos/sin scale
    ``attention_factor``, by default sqrt(1 + ln(s) / ln(original)) with s the context's
    growth (``factor``, else max_position_embeddings / original), 1 where s <= 1."""
    max_position = int(cfg.get("max_position_embeddings", 2048))
    original = cfg.get("original_max_position_embeddings")
    original = int(scaling.get("original_max_position_embeddings", max_position)
                   if original is None else original)  # fmt: skip
    if original <= 1:
        raise ModelError(f"{source}: original_max_position_embeddings is {original}")
    short, long = scaling["short_factor"], scaling["long_factor"]
    if not (isinstance(short, list) and isinstance(long, list) and len(short) == len(long)):
        raise ModelError(f"{source}: longrope's short_factor and long_factor must be lists "
                         "of one length")  # fmt: skip
    growth = float(_optional(scaling, "factor", max_position / original))
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None and growth <= 1:
        attention_factor = 1.0
    elif attention_factor is None:
        attention_factor = math.sqrt(1 + math.log(growth) / math.log(original))
    return RopeConfig(
        theta=theta,
        rope_type="longrope",
        original_max_position=original,
        short_factor=tuple(float(f) for f in short),
        long_factor=tuple(float(f) for f in long),
        attention_factor=float(attention_factor),
    )


def _lenient_rope(cfg: dict[str, Any], source: Path, arch: str) -> RopeConfig:
    """The rope settings where batchjob only needs sizes (vLLM computes rope itself)."""
    try:
        return _parse_rope(cfg, source, arch)
    except ModelError:
        return RopeConfig(theta=float(cfg.get("rope_theta", 10000.0)), rope_type="default")


def _sliding_window(arch: str, cfg: dict[str, Any], source: Path) -> int | None:
    window = cfg.get("sliding_window", 4096 if arch in _GEMMA3 else None)  # transformers'
    # default where Gemma3's config.json leaves it out
    if window is None:
        return None
    layer_types = cfg.get("layer_types") or []
    applies = arch in _WINDOWED or cfg.get("use_sliding_window")
    if not (applies or "sliding_attention" in layer_types):
        return None  # Qwen2/Qwen3 carry a window size but only use it when enabled
    try:
        window = int(window)
    except (TypeError, ValueError) as e:
        raise ModelError(f"{source}: sliding_window is not an integer: {window!r}") from e
    if window <= 0:
        raise ModelError(f"{source}: sliding_window is {window}; it must be positive")
    return window


def _window_layers(
    arch: str, cfg: dict[str, Any], num_layers: int, window: int | None, source: Path
) -> tuple[bool, ...] | None:
    """Per layer: whether the sliding window applies, from ``layer_types`` (OLMo3's: three
    layers in four; transformers writes it for Qwen2/Qwen3), or Qwen's ``max_window_layers``
    rule where a config enables the window without the list (layers from that index on);
    None: every layer (Mistral, Phi3), or no window."""
    if window is None:
        return None
    types = cfg.get("layer_types")
    if types is None and arch in _GEMMA3:  # its legacy key, else transformers' default
        every = int(_optional(cfg, "sliding_window_pattern", 6))
        types = [
            "sliding_attention" if (i + 1) % every else "full_attention" for i in range(num_layers)
        ]
    if types is None and cfg.get("use_sliding_window") and "max_window_layers" in cfg:
        first = int(cfg["max_window_layers"])
        types = ["sliding_attention" if i >= first else "full_attention" for i in range(num_layers)]
    if types is None:
        return None
    if not isinstance(types, list) or len(types) != num_layers:
        raise ModelError(f"{source}: layer_types must list one type per layer ({num_layers})")
    known = {"sliding_attention", "full_attention"}
    if not set(types) <= known:
        raise ModelError(
            f"{source}: layer_types {sorted(set(types) - known)} are not supported "
            "(sliding_attention, full_attention)"
        )
    return tuple(t == "sliding_attention" for t in types)


def _rope_layers(
    arch: str, cfg: dict[str, Any], num_layers: int, source: Path
) -> tuple[bool, ...] | None:
    """SmolLM3's ``no_rope_layers`` (1: the layer applies RoPE, 0: it does not; HF's default
    without the list: every ``no_rope_layer_interval``-th layer without) as a tuple of bools;
    None for the other families (RoPE in every layer)."""
    if arch != "SmolLM3ForCausalLM":
        return None
    flags = cfg.get("no_rope_layers")
    if flags is None:
        every = int(_optional(cfg, "no_rope_layer_interval", 4))
        if every <= 0:
            raise ModelError(f"{source}: no_rope_layer_interval is {every}; it must be positive")
        flags = [int((i + 1) % every != 0) for i in range(num_layers)]
    if not isinstance(flags, list) or len(flags) != num_layers:
        raise ModelError(f"{source}: no_rope_layers must list one 0/1 per layer ({num_layers})")
    return tuple(bool(f) for f in flags)


def _rotary_dim(
    arch: str, cfg: dict[str, Any], head_dim: int, rope: RopeConfig, source: Path
) -> int:
    """The dims of a head RoPE rotates where that is not all of them (0 where it is):
    ``int(head_dim * partial_rotary_factor)``, as transformers rounds it; longrope's factor
    lists must have one entry per rotated pair."""
    factor = _partial_rotary_factor(cfg, source, arch)
    dims = int(head_dim * factor)
    if factor != 1.0 and arch not in _PARTIAL_ROTARY:
        raise ModelError(
            f"{source}: partial_rotary_factor {factor} is not supported for {arch} "
            f"(the native engine rotates part of a head for {', '.join(_PARTIAL_ROTARY)})"
        )
    if dims < 2 or dims % 2:
        raise ModelError(
            f"{source}: partial_rotary_factor {factor} rotates {dims} of {head_dim} head dims; "
            "RoPE needs an even number, at least 2"
        )
    if rope.rope_type == "longrope" and len(rope.short_factor) != dims // 2:
        raise ModelError(
            f"{source}: longrope's short_factor has {len(rope.short_factor)} entries; "
            f"{dims} rotated dims need {dims // 2}"
        )
    return 0 if dims == head_dim else dims


def _check_gemma3(cfg: dict[str, Any], source: Path) -> None:
    """What of Gemma3's config the native engine does not run: refused, naming the key."""
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if cfg.get(key) is not None:
            raise ModelError(f"{source}: {key} is not supported by the native engine")
    if cfg.get("use_bidirectional_attention"):
        raise ModelError(f"{source}: use_bidirectional_attention is not supported")


def _gemma3_settings(cfg: dict[str, Any], hidden: int, source: Path) -> dict[str, Any]:
    """Gemma3's ``ModelConfig`` fields: the sliding layers' RoPE, norms of 1 + weight, the
    embedding scaled by sqrt(hidden) rounded to the model's dtype, the softmax scale
    query_pre_attn_scalar^-0.5."""
    local = _rope_of(_gemma3_rope_settings(cfg)[1], cfg, source, "Gemma3ForCausalLM")
    scalar = float(_optional(cfg, "query_pre_attn_scalar", 256))
    if scalar <= 0:
        raise ModelError(f"{source}: query_pre_attn_scalar is {scalar}; it must be positive")
    return {
        "sliding_rope": local,
        "norm_offset": 1.0,
        "embedding_multiplier": hidden**0.5,
        "embedding_scale_in_dtype": True,
        "attention_multiplier": scalar**-0.5,
    }


def _granite_scalars(arch: str, cfg: dict[str, Any], source: Path) -> dict[str, Any]:
    """Granite's multipliers as ``ModelConfig`` fields ({} for the other families)."""
    if arch != "GraniteForCausalLM":
        return {}
    keys = ("embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling")
    try:
        out: dict[str, Any] = {k: float(_optional(cfg, k, 1.0)) for k in keys}
    except (TypeError, ValueError) as e:
        raise ModelError(f"{source}: a Granite multiplier is not a number: {e}") from e
    if out["logits_scaling"] == 0:
        raise ModelError(f"{source}: logits_scaling is 0 (the logits are divided by it)")
    return out


def parse_hf_config(
    cfg: dict[str, Any], generation: dict[str, Any] | None, source: Path, native: bool = True
) -> ModelConfig:
    """config.json (``cfg``) + generation_config.json (or None) -> ``ModelConfig``.

    ``source`` (the config.json path) names the file in every ``ModelError``. ``native``:
    refuse what the native engine cannot run (architecture, activation, rope type); without
    it (the vLLM backend, which checks its own models) any architecture is read for its sizes.
    """
    cfg = {**(cfg.get("text_config") or {}), **cfg}  # multimodal configs nest the LM's numbers
    archs = cfg.get("architectures") or []
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None and not native and archs:
        arch = str(archs[0])
    if arch is None:
        raise ModelError(
            f"{source}: unsupported architecture {archs or cfg.get('model_type')!r} "
            f"(supported by the native engine: {', '.join(SUPPORTED_ARCHITECTURES)}; "
            "engine.backend = 'vllm' runs the others)"
        )
    quant = cfg.get("quantization_config")
    if native and quant:
        method = quant.get("quant_method") if isinstance(quant, dict) else None
        raise ModelError(
            f"{source}: quantization_config ({method or 'a quantized checkpoint'}) is not run "
            'by the native engine (full-precision weights only); engine.backend = "vllm" '
            "loads it as its config.json declares"
        )
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu"
    if native and act not in ACTIVATIONS:
        raise ModelError(
            f"{source}: hidden_act {act!r} is not supported ({', '.join(ACTIVATIONS)})"
        )
    if native and arch in _GEMMA3:
        _check_gemma3(cfg, source)
    try:
        hidden = int(cfg["hidden_size"])
        heads = int(cfg["num_attention_heads"])
        num_layers = int(cfg["num_hidden_layers"])
        vocab = int(cfg["vocab_size"])
        inter = int(cfg["intermediate_size"])
    except KeyError as e:
        raise ModelError(f"{source}: missing key {e.args[0]!r}") from e
    except (TypeError, ValueError) as e:
        raise ModelError(f"{source}: a size is not an integer: {e}") from e
    try:
        kv_heads = int(_optional(cfg, "num_key_value_heads", heads))
        head_dim = int(_optional(cfg, "head_dim", 0))
    except (TypeError, ValueError) as e:
        raise ModelError(f"{source}: a size is not an integer: {e}") from e
    sizes = {"hidden_size": hidden, "num_attention_heads": heads, "num_hidden_layers": num_layers}
    sizes |= {"vocab_size": vocab, "intermediate_size": inter, "num_key_value_heads": kv_heads}
    if "head_dim" in cfg and cfg["head_dim"] is not None:
        sizes["head_dim"] = head_dim
    for key, value in sizes.items():
        if value <= 0:  # before any division by it
            raise ModelError(f"{source}: {key} is {value}; it must be a positive integer")
    if not head_dim:
        if hidden % heads:
            raise ModelError(
                f"{source}: hidden_size {hidden} is not a multiple of num_attention_heads "
                f"{heads} (and no head_dim is given)"
            )
        head_dim = hidden // heads
    if heads % kv_heads:
        raise ModelError(
            f"{source}: num_attention_heads {heads} not a multiple of kv heads {kv_heads}"
        )

    rope = _parse_rope(cfg, source, arch) if native else _lenient_rope(cfg, source, arch)
    window = _sliding_window(arch, cfg, source)
    rotary_dim = _rotary_dim(arch, cfg, head_dim, rope, source) if native else 0
    attention_bias = bool(cfg.get("attention_bias", False))
    qwen2 = arch == "Qwen2ForCausalLM"
    eos = _as_id_list(cfg.get("eos_token_id"))
    bos = cfg.get("bos_token_id")
    if generation is not None:
        eos = eos + [t for t in _as_id_list(generation.get("eos_token_id")) if t not in eos]
        bos = generation.get("bos_token_id", bos) if bos is None else bos
    return ModelConfig(
        architecture=arch,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=inter,
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope=rope,
        max_position=int(cfg.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(_optional(cfg, "tie_word_embeddings", arch in _GEMMA3)),
        qkv_bias=qwen2 or (attention_bias and arch != "MistralForCausalLM"),
        o_bias=attention_bias and arch not in _NO_O_BIAS,
        mlp_bias=bool(cfg.get("mlp_bias", False)) and arch in _MLP_BIAS,
        qk_norm=arch in ("Qwen3ForCausalLM", *_OLMO, *_GEMMA3),
        qk_norm_whole=arch in _OLMO,
        sliding_window=window,
        window_layers=_window_layers(arch, cfg, num_layers, window, source),
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=tuple(eos),
        torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
        rope_layers=_rope_layers(arch, cfg, num_layers, source),
        branch_norms=arch in (*_OLMO, *_GEMMA3),
        input_norms=arch not in _OLMO,
        rotary_dim=rotary_dim,
        activation=ACTIVATIONS.get(act, "silu"),
        **_granite_scalars(arch, cfg, source),
        **(_gemma3_settings(cfg, hidden, source) if arch in _GEMMA3 and native else {}),
    )


# generation_config.json keys that are sampling defaults, as vLLM's ``generation_config =
# "auto"`` takes them (ModelConfig.get_diff_sampling_param) -> the [sampling] key they set,
# and transformers' GenerationConfig default: a value equal to it is no default of the
# checkpoint's (vLLM reads ``GenerationConfig.to_diff_dict()``)
GENERATION_SAMPLING_KEYS: dict[str, tuple[str, Any]] = {
    "temperature": ("temperature", 1.0),
    "top_p": ("top_p", 1.0),
    "top_k": ("top_k", 50),
    "min_p": ("min_p", None),
    "repetition_penalty": ("repetition_penalty", 1.0),
    "presence_penalty": ("presence_penalty", None),
    "frequency_penalty": ("frequency_penalty", None),
    "max_new_tokens": ("max_tokens", None),
}


def generation_sampling_defaults(generation: dict[str, Any] | None) -> dict[str, Any]:
    """The [sampling] defaults a generation_config.json sets -> {sampling key: value}: each
    key of ``GENERATION_SAMPLING_KEYS`` whose value is set and differs from transformers'
    default (vLLM's rule; ``do_sample`` is ignored, as vLLM ignores it)."""
    out: dict[str, Any] = {}
    for name, (key, hf_default) in GENERATION_SAMPLING_KEYS.items():
        value = (generation or {}).get(name)
        if value is not None and value != hf_default:
            out[key] = value
    return out


def read_generation_sampling_defaults(folder: Path) -> tuple[dict[str, Any], Path]:
    """``generation_sampling_defaults`` of ``folder``'s generation_config.json ({} without
    one) and the file's path; ModelError for a file that does not parse."""
    path = Path(folder) / "generation_config.json"
    if not path.is_file():
        return {}, path
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelError(f"cannot read {path}: {e}") from None
    return generation_sampling_defaults(data if isinstance(data, dict) else None), path
