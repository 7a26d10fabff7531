"""Model shapes from a transformers-style config dict, and the cache bytes they imply.

Works from config.json alone (no weights). Tolerant of:
- nested language-model configs (`text_config`, `language_config`, `llm_config`, `thinker_config.text_config`),
- `head_dim` given explicitly (Qwen3: 128 even where hidden/heads differs) or derived as hidden/heads,
- hybrid layouts given by `layer_types` (`full_attention`, `sliding_attention`, `linear_attention`, `mamba`)
  or by `full_attention_interval` (Qwen3-Next / Qwen3.5: layer i is full attention when (i+1) % interval == 0),
- Qwen2/Qwen3-style `use_sliding_window` + `max_window_layers`,
- DFlash drafters (`dflash_config`, `block_size`, `target_layer_ids`, flat or nested).

Cache formulas (bytes; `b` = bytes per element of the cache dtype):
- full attention, per token:     2 * n_full * kv_heads * head_dim * b
- sliding attention, per token:  2 * n_sliding * kv_heads * head_dim * b, per request capped at the window
- Gated DeltaNet state, per request while speculating K tokens (vLLM keeps 1 + K state slots, each with a
  conv state widened by K rows; shapes from vLLM's `MambaStateShapeCalculator.gated_delta_net_state_shape`):
      (1 + K) * n_linear * [ (conv_kernel - 1 + K) * conv_dim * b_conv + v_heads * k_dim * v_dim * b_ssm ]
      conv_dim = 2 * k_heads * k_dim + v_heads * v_dim
- Mamba2 state: same, with conv_dim = d_inner + 2 * n_groups * d_state and recurrent state heads * head_dim * d_state.
The recurrent (ssm) state uses `mamba_ssm_dtype` when the config names one (Qwen3.5: float32), else the
model dtype; the conv state uses the model dtype.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, overload

from dflash_quant.errors import DFlashQuantError, UsageError
from dflash_quant.models.config_check import check_model_fields, draft_fields, positive_int

DTYPE_BYTES: dict[str, int] = {
    "float32": 4,
    "fp32": 4,
    "float": 4,
    "bfloat16": 2,
    "bf16": 2,
    "float16": 2,
    "fp16": 2,
    "half": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "fp8": 1,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
    "int8": 1,
    "uint8": 1,
    "int32": 4,
    "int64": 8,
    "int16": 2,
    "bool": 1,
}


def dtype_bytes(name: str, *, what: str = "dtype") -> int:
    key = str(name).strip().lower().replace("torch.", "")
    if key not in DTYPE_BYTES:
        raise UsageError(f"unknown {what} {name!r}; use one of bf16, fp16, fp32, fp8")
    return DTYPE_BYTES[key]


FULL = "full_attention"
SLIDING = "sliding_attention"
LINEAR = "linear_attention"
MAMBA = "mamba"

_LAYER_ALIASES = {
    "full_attention": FULL,
    "attention": FULL,
    "global": FULL,
    "full": FULL,
    "sliding_attention": SLIDING,
    "sliding_window": SLIDING,
    "local": SLIDING,
    "chunked_attention": SLIDING,
    "linear_attention": LINEAR,
    "linear": LINEAR,
    "gated_deltanet": LINEAR,
    "mamba": MAMBA,
    "mamba2": MAMBA,
}


@dataclass(frozen=True)
class RecurrentState:
    """Per-layer state of a linear-attention (Gated DeltaNet) or Mamba2 layer."""

    kind: str  # "gated_deltanet" | "mamba2"
    num_layers: int
    conv_kernel: int
    conv_dim: int
    state_elems: int  # recurrent state elements per layer (v_heads * k_dim * v_dim)
    ssm_dtype: str | None  # from the config (mamba_ssm_dtype), None = model dtype
    # for weight counting (GDN)
    k_heads: int = 0
    v_heads: int = 0
    k_dim: int = 0
    v_dim: int = 0


@dataclass(frozen=True)
class ModelShape:
    num_layers: int
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    layer_types: tuple[str, ...]
    sliding_window: int | None
    dtype: str
    tie_word_embeddings: bool
    max_position_embeddings: int | None
    recurrent: RecurrentState | None = None
    attn_output_gate: bool = False
    # MoE (counted for weights only)
    num_experts: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    # DFlash drafter
    is_drafter: bool = False
    block_size: int | None = None
    num_taps: int = 0
    target_layer_ids: tuple[int, ...] = ()
    quantization: dict[str, Any] | None = None
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def n_full(self) -> int:
        return sum(1 for t in self.layer_types if t == FULL)

    @property
    def n_sliding(self) -> int:
        return sum(1 for t in self.layer_types if t == SLIDING)

    @property
    def n_recurrent(self) -> int:
        return sum(1 for t in self.layer_types if t in (LINEAR, MAMBA))


def read_config(src: str | Path | dict) -> dict:
    """A dict, a config.json path, or a directory holding config.json."""
    if isinstance(src, dict):
        return src
    path = Path(src)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise DFlashQuantError(f"no config.json at {path}; pass a model directory, a config.json or a preset name")
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise DFlashQuantError(f"cannot read {path} as JSON ({exc}); pass a valid config.json") from exc
    if not isinstance(data, dict):
        raise DFlashQuantError(f"{path} is not a JSON object; pass a transformers config.json")
    return data


def text_config(cfg: dict) -> dict:
    """The language-model part of a (possibly multimodal) config; top-level keys fill gaps."""
    for key in ("text_config", "language_config", "llm_config"):
        sub = cfg.get(key)
        if isinstance(sub, dict) and ("num_hidden_layers" in sub or "hidden_size" in sub):
            return {**{k: v for k, v in cfg.items() if k != key}, **sub}
    thinker = cfg.get("thinker_config")
    if isinstance(thinker, dict):
        return text_config({**cfg, **thinker}) if "text_config" in thinker else {**cfg, **thinker}
    return cfg


# A required field or an int default always yields an int; the overloads tell the type checker so.
@overload
def _int(cfg: dict, *keys: str, default: int, required: bool = ..., what: str = ...) -> int: ...
@overload
def _int(cfg: dict, *keys: str, default: None = ..., required: Literal[True], what: str = ...) -> int: ...
@overload
def _int(cfg: dict, *keys: str, default: int | None = ..., required: bool = ..., what: str = ...) -> int | None: ...
def _int(cfg: dict, *keys: str, default: int | None = None, required: bool = False, what: str = "") -> int | None:
    for k in keys:
        v = cfg.get(k)
        if v is not None:
            try:
                return int(v)
            except (TypeError, ValueError) as exc:
                raise DFlashQuantError(f"config field {k}={v!r} is not an integer; fix the config.json") from exc
    if required:
        raise DFlashQuantError(
            f"config has no {what or keys[0]} (looked for {', '.join(keys)}); "
            "pass the model's full config.json (with its layer counts), or a preset name"
        )
    return default


def _layer_types(cfg: dict, n_layers: int) -> list[str]:
    lt = cfg.get("layer_types")
    if isinstance(lt, list) and lt:
        out = []
        for t in lt:
            key = _LAYER_ALIASES.get(str(t).lower())
            if key is None:
                raise DFlashQuantError(
                    f"unknown layer type {t!r} in layer_types; expected full_attention, sliding_attention, "
                    "linear_attention or mamba"
                )
            out.append(key)
        if len(out) != n_layers:
            raise DFlashQuantError(
                f"layer_types has {len(out)} entries but num_hidden_layers is {n_layers}; fix the config.json"
            )
        return out
    interval = cfg.get("full_attention_interval")
    if interval and "linear_num_value_heads" in cfg:
        interval = int(interval)
        return [FULL if (i + 1) % interval == 0 else LINEAR for i in range(n_layers)]
    pattern = cfg.get("hybrid_override_pattern")  # NemotronH: M = mamba, * = attention, - = MLP only
    if isinstance(pattern, str) and len(pattern) == n_layers:
        return [MAMBA if c == "M" else FULL if c == "*" else "mlp" for c in pattern]
    if cfg.get("use_sliding_window") and cfg.get("sliding_window"):
        mwl = int(cfg.get("max_window_layers", n_layers))
        return [SLIDING if i >= mwl else FULL for i in range(n_layers)]
    return [FULL] * n_layers


def _recurrent(cfg: dict, layer_types: list[str]) -> RecurrentState | None:
    n_lin = sum(1 for t in layer_types if t == LINEAR)
    n_mamba = sum(1 for t in layer_types if t == MAMBA)
    if n_lin:
        kh = _int(cfg, "linear_num_key_heads", required=True, what="linear_num_key_heads (Gated DeltaNet)")
        vh = _int(cfg, "linear_num_value_heads", required=True, what="linear_num_value_heads (Gated DeltaNet)")
        kd = _int(cfg, "linear_key_head_dim", required=True, what="linear_key_head_dim (Gated DeltaNet)")
        vd = _int(cfg, "linear_value_head_dim", required=True, what="linear_value_head_dim (Gated DeltaNet)")
        ck = _int(cfg, "linear_conv_kernel_dim", "conv_kernel", default=4)
        return RecurrentState(
            kind="gated_deltanet",
            num_layers=n_lin,
            conv_kernel=ck,
            conv_dim=2 * kh * kd + vh * vd,
            state_elems=vh * kd * vd,
            ssm_dtype=cfg.get("mamba_ssm_dtype"),
            k_heads=kh,
            v_heads=vh,
            k_dim=kd,
            v_dim=vd,
        )
    if n_mamba:
        heads = _int(cfg, "mamba_num_heads", "mamba_n_heads", required=True, what="mamba_num_heads")
        hd = _int(cfg, "mamba_head_dim", "mamba_d_head", required=True, what="mamba_head_dim")
        d_state = _int(cfg, "ssm_state_size", "mamba_d_state", "state_size", required=True, what="ssm_state_size")
        groups = _int(cfg, "n_groups", "mamba_n_groups", default=1)
        ck = _int(cfg, "conv_kernel", "mamba_d_conv", default=4)
        d_inner = heads * hd
        return RecurrentState(
            kind="mamba2",
            num_layers=n_mamba,
            conv_kernel=ck,
            conv_dim=d_inner + 2 * groups * d_state,
            state_elems=heads * hd * d_state,
            ssm_dtype=cfg.get("mamba_ssm_dtype"),
            v_heads=heads,
            v_dim=hd,
            k_dim=d_state,
        )
    return None


def _gated_by_type(cfg: dict) -> bool:
    """Qwen3.5 / Qwen3-Next attention always gates its output (q_proj is 2 x heads x head_dim wide) even when
    the saved config omits `attn_output_gate` (transformers' Qwen3_5TextConfig does not write it)."""
    return str(cfg.get("model_type", "")).startswith(("qwen3_5", "qwen3_next"))


# A config-only budget has no weights to check the layer count against; no released model comes near this.
MAX_LAYERS = 4096


def parse_shape(src: str | Path | dict, source: str = "config") -> ModelShape:
    """ModelShape from a config dict / file / directory. Raises DFlashQuantError on missing or malformed counts.

    The count fields are checked by config_check (the same checks the loader applies); a DFlash drafter's
    block size and taps come from config_check.draft_fields, the one reading of a drafter config."""

    if not isinstance(src, dict) and source == "config":
        source = str(src)
    raw = read_config(src)
    cfg = text_config(raw)
    check_model_fields(cfg, source)
    n_layers = _int(cfg, "num_hidden_layers", "n_layer", "num_layers", required=True, what="num_hidden_layers")
    positive_int(n_layers, "num_hidden_layers", source)
    if n_layers > MAX_LAYERS:
        raise DFlashQuantError(
            f"{source}: num_hidden_layers {n_layers:,} is implausible (more than {MAX_LAYERS}); fix the config"
        )
    hidden = _int(cfg, "hidden_size", "d_model", "n_embd", required=True, what="hidden_size")
    heads = _int(cfg, "num_attention_heads", "n_head", required=True, what="num_attention_heads")
    kv = _int(cfg, "num_key_value_heads", default=heads)
    for key, value in (("hidden_size", hidden), ("num_attention_heads", heads), ("num_key_value_heads", kv)):
        positive_int(value, key, source)
    head_dim = _int(cfg, "head_dim", default=None) or hidden // heads
    layer_types = _layer_types(cfg, n_layers)
    sliding = _int(cfg, "sliding_window", default=None) if SLIDING in layer_types else None
    if SLIDING in layer_types and not sliding:
        raise DFlashQuantError("layer_types has sliding_attention layers but sliding_window is missing; fix the config")
    dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or raw.get("torch_dtype") or raw.get("dtype") or "bfloat16")
    dflash = raw.get("dflash_config")
    archs = [str(a) for a in (raw.get("architectures") or [])] if isinstance(raw.get("architectures"), list) else []
    is_drafter = bool(dflash) or any("DFlash" in a for a in archs) or raw.get("target_layer_ids") is not None
    taps, num_taps, block = [], 0, None
    if is_drafter:
        fields = draft_fields(raw, source, shape_only=True)
        taps, block = fields.target_layer_ids, fields.block_size
        num_taps = len(taps) or (min(n_layers, 5) if n_layers > 1 else 1)  # z-lab spacing: one tap per layer
    quant = raw.get("quantization_config") if isinstance(raw.get("quantization_config"), dict) else None
    return ModelShape(
        num_layers=n_layers,
        hidden_size=hidden,
        intermediate_size=_int(cfg, "intermediate_size", "ffn_hidden_size", default=4 * hidden),
        vocab_size=_int(cfg, "vocab_size", default=0),
        num_attention_heads=heads,
        num_kv_heads=kv,
        head_dim=head_dim,
        layer_types=tuple(layer_types),
        sliding_window=sliding,
        dtype=dtype,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", raw.get("tie_word_embeddings", False))),
        max_position_embeddings=_int(cfg, "max_position_embeddings", default=None),
        recurrent=_recurrent(cfg, layer_types),
        attn_output_gate=bool(cfg.get("attn_output_gate", _gated_by_type(cfg))),
        num_experts=_int(cfg, "num_experts", "num_local_experts", "n_routed_experts", default=0) or 0,
        moe_intermediate_size=_int(cfg, "moe_intermediate_size", default=0) or 0,
        shared_expert_intermediate_size=_int(cfg, "shared_expert_intermediate_size", default=0) or 0,
        is_drafter=is_drafter,
        block_size=block,
        num_taps=num_taps,
        target_layer_ids=tuple(int(t) for t in (taps or [])),
        quantization=quant,
        raw=raw,
    )


# ---------------------------------------------------------------------------------------------- caches


@dataclass(frozen=True)
class KVPerToken:
    full_bytes: int  # per token, all full-attention layers
    sliding_bytes: int  # per token, all sliding-window layers (capped at `window` tokens per request)
    window: int | None

    @property
    def uncapped_bytes(self) -> int:
        return self.full_bytes + self.sliding_bytes

    def bytes_for(self, tokens: int) -> int:
        """Cache bytes for one request holding `tokens` tokens."""
        if tokens < 0:
            raise UsageError(f"context must not be negative (got {tokens})")
        capped = min(tokens, self.window) if self.window else tokens
        return self.full_bytes * tokens + self.sliding_bytes * capped


def kv_per_token(shape: ModelShape, kv_dtype: str | None = None) -> KVPerToken:
    """K and V of every attention layer for one token; linear/mamba layers hold no per-token cache."""
    b = dtype_bytes(kv_dtype or shape.dtype, what="KV dtype")
    per_layer = 2 * shape.num_kv_heads * shape.head_dim * b
    return KVPerToken(per_layer * shape.n_full, per_layer * shape.n_sliding, shape.sliding_window)


def recurrent_state_bytes(
    shape: ModelShape, spec_tokens: int = 0, *, conv_dtype: str | None = None, ssm_dtype: str | None = None
) -> int:
    """Per-request linear-attention / Mamba state while speculating `spec_tokens` tokens (0 if none).

    (1 + K) slots x n_layers x [(conv_kernel - 1 + K) x conv_dim x b_conv + state_elems x b_ssm]
    """
    r = shape.recurrent
    if r is None:
        return 0
    if spec_tokens < 0:
        raise UsageError(f"--spec-tokens must not be negative (got {spec_tokens})")
    b_conv = dtype_bytes(conv_dtype or shape.dtype, what="conv state dtype")
    b_ssm = dtype_bytes(ssm_dtype or r.ssm_dtype or shape.dtype, what="state dtype")
    per_slot = r.num_layers * ((r.conv_kernel - 1 + spec_tokens) * r.conv_dim * b_conv + r.state_elems * b_ssm)
    return (1 + spec_tokens) * per_slot
