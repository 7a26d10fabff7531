"""MTP (the target's own multi-token-prediction head) as a speculation method, and `budget --compare-mtp`.

Qwen3.5/3.6-class targets ship an MTP module (`mtp_num_hidden_layers` in the text config, weights under
`mtp.*`): an fc over [embedding; hidden] (2H -> H), pre-fc norms on both halves, decoder layer(s) with the
target's full-attention variant and MLP, and a final norm. Embedding and lm_head are the target's unless
`mtp_use_dedicated_embeddings`. vLLM builds it in `vllm/model_executor/models/qwen3_5_mtp.py`; see
docs/memory.md ("MTP vs DFlash") for the places where vLLM allocates differently for MTP.

Everything here is the vLLM engine (the reference loop of this project has no MTP path). Per method::

    required(C, ctx) = target_weights + draft_weights + activation(C) + overhead + cuda_graphs
                       + C * per_request(ctx)
    per_request(ctx) = target_kv(ctx) + target_state(1 or 2 + K slots) + draft_kv(ctx) + kv_group_padding(ctx)

`kv_group_padding` is what vLLM's hybrid KV-cache grouping allocates for padding layers: it splits layers
into buckets of one KV spec, cuts every bucket into groups of one size (the smallest bucket, or the largest
when all are within 1.5x) and pads the last group of each bucket (`_get_kv_cache_groups_uniform_page_size`).
Qwen3.5-27B alone (16 full + 48 GDN) pads nothing; its MTP layer joins the full-attention bucket (17), so
the 48 GDN layers are padded to 51 and every request pays 3 more state pages per slot.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

from dflash_quant.errors import UsageError
from dflash_quant.io.weights import weight_files
from dflash_quant.memory.budget import (
    BudgetSettings,
    DrafterSpec,
    ModelSpec,
    activation_bytes,
    cache_bytes,
    validate_settings,
)
from dflash_quant.memory.engine import (
    ACT_BYTES,
    LOGITS_COPIES,
    drafter_layer_keys,
    kv_buckets,
    layer_peak,
    padding_bytes,
    padding_layers,
    round_up,
)
from dflash_quant.memory.hybrid import hybrid_layout
from dflash_quant.memory.kv import (
    FULL,
    ModelShape,
    dtype_bytes,
    text_config,
)
from dflash_quant.memory.weights import count_params, priced_bytes, weights_from_files

DEFAULT_MTP_TOKENS = (1, 2, 3)
MTP_WEIGHT_FORMATS = ("bf16", "fp16", "fp8", "int8", "int4")


# ------------------------------------------------------------------------------------------- the head


@dataclass(frozen=True)
class MTPHead:
    num_layers: int
    dedicated_embeddings: bool


def mtp_head(shape: ModelShape) -> MTPHead | None:
    """The MTP head a target config declares (`mtp_num_hidden_layers`, Qwen3-Next's `num_nextn_predict_layers`)."""
    cfg = text_config(shape.raw) if shape.raw else {}
    n = cfg.get("mtp_num_hidden_layers", cfg.get("num_nextn_predict_layers"))
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        return None
    return MTPHead(n, bool(cfg.get("mtp_use_dedicated_embeddings", False)))


def require_mtp_head(shape: ModelShape, label: str) -> MTPHead:
    head = mtp_head(shape)
    if head is None:
        raise UsageError(
            f"{label} has no MTP head (no mtp_num_hidden_layers >= 1 in its config); "
            "--compare-mtp needs a target that ships one (Qwen3.5/3.6-class)"
        )
    return head


def mtp_param_count(shape: ModelShape, head: MTPHead):
    """Parameters of the MTP module: its decoder layers counted like the target's full-attention layers
    (gated q, q/k norms, MLP or MoE), plus fc (2H -> H), the two pre-fc norms and the final norm;
    the embedding only when the head has its own."""
    layers = replace(shape, num_layers=head.num_layers, layer_types=(FULL,) * head.num_layers, vocab_size=0,
                     tie_word_embeddings=True, is_drafter=False)  # fmt: skip
    pc = count_params(layers)  # its "norms" include one final norm (H): the MTP's `norm`
    h = shape.hidden_size
    pc.linears.insert(0, ("mtp_fc", 2 * h, h))
    pc.other["norms"] = pc.other.get("norms", 0) + 2 * h  # pre_fc_norm_embedding, pre_fc_norm_hidden
    if head.dedicated_embeddings:
        pc.other["mtp_embed_tokens"] = shape.vocab_size * h
    return pc


@dataclass(frozen=True)
class MTPWeights:
    bytes: int
    source: str
    file_bytes_in_target: int  # mtp.* bytes found in the target's files (0 when counted from the config)


def mtp_file_bytes(root) -> int:
    """Bytes of the `mtp.*` tensors in a checkpoint (headers only)."""
    rep = weights_from_files(root)
    return sum(n for mod, n in rep.by_module.items() if mod.startswith("mtp.") or ".mtp." in f".{mod}")


def resolve_mtp_weights(shape: ModelShape, head: MTPHead, root=None, fmt: str | None = None) -> MTPWeights:
    """From the checkpoint's `mtp.*` tensors when the files are there (unless a format is forced), else counted."""
    found = mtp_file_bytes(root) if root is not None and weight_files(root, required=False) else 0
    if fmt is None and found:
        return MTPWeights(found, "mtp.* tensors in the checkpoint (safetensors headers)", found)
    form = (fmt or "bf16").lower()
    if form not in MTP_WEIGHT_FORMATS:
        raise UsageError(f"unknown --mtp-weights {fmt!r}; use one of {', '.join(MTP_WEIGHT_FORMATS)}")
    why = "counted from config" if not found else "counted from config (format forced; checkpoint has mtp.*)"
    if root is not None and weight_files(root, required=False) and not found:
        why = "counted from config: the checkpoint has no mtp.* tensors, vLLM's MTP cannot load it"
    return MTPWeights(priced_bytes(mtp_param_count(shape, head), form), f"{why} at {form}", found)


def mtp_kv_per_token(shape: ModelShape, head: MTPHead, kv_dtype: str | None = None) -> int:
    """K and V of the MTP layers for one token: each is a full-attention layer with the target's heads."""
    b = dtype_bytes(kv_dtype or shape.dtype, what="KV dtype")
    return head.num_layers * 2 * shape.num_kv_heads * shape.head_dim * b


# ----------------------------------------------------------------------------- vLLM KV-cache grouping


# ------------------------------------------------------------------------------------------ methods


@dataclass
class Method:
    """One way to decode: what it adds to the fixed costs and what every request holds."""

    name: str
    label: str
    spec_tokens: int
    draft_weights: int
    draft_weights_source: str
    activation: Callable[[int], int]  # concurrency -> bytes
    per_request: Callable[[int], dict[str, int]]  # tokens -> {term: bytes}
    state_slots: int
    padding_layers: dict = field(default_factory=dict)


def _tokens(s: BudgetSettings, context: int) -> int:
    return round_up(context, s.block_size)


def no_spec_method(t: ModelSpec, s: BudgetSettings) -> Method:
    shape = t.shape
    buckets = kv_buckets(shape, [])

    def per_request(tokens: int) -> dict[str, int]:
        c = cache_bytes(t, _no_drafter(shape), replace(s, spec_tokens=0), tokens)
        return {"target_kv": c["target_kv"], "target_state": c["target_state"], "draft_kv": 0,
                "kv_group_padding": padding_bytes(shape, buckets, s, tokens, 0)}  # fmt: skip

    def act(conc: int) -> int:
        if s.activation_bytes is not None:
            return s.activation_bytes
        rows = max(s.max_num_seqs, conc)
        return layer_peak(shape, s.prefill_chunk) + rows * shape.vocab_size * 4 * LOGITS_COPIES

    return Method("none", "none", 0, 0, "-", act, per_request, _slots(shape, s, 0),
                  padding_layers(buckets))  # fmt: skip


def mtp_method(t: ModelSpec, head: MTPHead, weights: MTPWeights, s: BudgetSettings, k: int) -> Method:
    """MTP with K speculative tokens: the MTP layer runs K times per step (vLLM reuses layer k % n_predict)."""
    shape = t.shape
    if k < 1:
        raise UsageError(f"--mtp-tokens must be at least 1 (got {k})")
    if k > head.num_layers and k % head.num_layers:
        raise UsageError(f"--mtp-tokens {k} is not a multiple of the {head.num_layers} MTP layers; vLLM refuses it")
    buckets = kv_buckets(shape, [(FULL, shape.num_kv_heads, shape.head_dim, None)] * head.num_layers)
    kv_tok = mtp_kv_per_token(shape, head, s.kv_dtype)

    def per_request(tokens: int) -> dict[str, int]:
        c = cache_bytes(t, _no_drafter(shape), replace(s, spec_tokens=k), tokens)
        if shape.recurrent is not None:  # the head's pages live in the hybrid pool: whole blocks of vLLM's size
            lay = hybrid_layout(shape, kv_dtype=s.kv_dtype, state_dtype=s.state_dtype, spec_tokens=k,
                                prefix_caching=s.prefix_caching)  # fmt: skip
            tokens = round_up(tokens, lay.block_tokens)
        return {"target_kv": c["target_kv"], "target_state": c["target_state"], "draft_kv": kv_tok * tokens,
                "kv_group_padding": padding_bytes(shape, buckets, s, tokens, k)}  # fmt: skip

    def act(conc: int) -> int:
        return mtp_activation_bytes(shape, s, k, conc)

    return Method(f"mtp-k{k}", f"mtp-k{k}", k, weights.bytes, weights.source, act, per_request,
                  _slots(shape, s, k), padding_layers(buckets))  # fmt: skip


def _slots(shape: ModelShape, s: BudgetSettings, k: int) -> int:
    """State pages per request and linear layer: 1 + K, one more with prefix caching (memory/hybrid.py)."""
    if shape.recurrent is None:
        return 0
    return (2 if s.prefix_caching else 1) + k


def mtp_activation_bytes(shape: ModelShape, s: BudgetSettings, k: int, concurrency: int) -> int:
    """vLLM-style activation peak with MTP (T = prefill chunk, a = 2, the same terms as the DFlash formula):

      target layer peak          max(attention, MLP, linear-attention) transients + 2 T H a
      hidden states to the head  T H a        (the target's last hidden state, one per token; DFlash: n_taps T H a)
      MTP input                  T 4H a       (embeddings, [embedding; hidden] concat 2H, fc output)
      logits + sampler           max(max_num_seqs, C (K+1)) V 4 x 3
      MTP draft step             C (H + 3 I) a   (one token per request per step, K sequential steps)
    The MTP decoder layer over the chunk is the target's full-attention layer shape, so its transient is already
    bounded by the target layer peak (they run one after the other).
    """
    if s.activation_bytes is not None:
        return s.activation_bytes
    a, tok, h = ACT_BYTES, s.prefill_chunk, shape.hidden_size
    rows = max(s.max_num_seqs, concurrency * (k + 1))
    logits = rows * shape.vocab_size * 4 * LOGITS_COPIES
    draft_step = concurrency * (h + 3 * shape.intermediate_size) * a
    return layer_peak(shape, tok) + tok * h * a + tok * 4 * h * a + logits + draft_step


def dflash_method(t: ModelSpec, d: DrafterSpec, form: str, s: BudgetSettings) -> Method:
    """The DFlash drafter exactly as `budget` models it, plus vLLM's KV-group padding."""
    shape = t.shape
    dm = d.as_model("bf16" if form == "bf16" else "quantized")
    buckets = kv_buckets(shape, drafter_layer_keys(d.shape))
    k = s.spec_tokens

    def per_request(tokens: int) -> dict[str, int]:
        c = cache_bytes(t, dm, s, tokens)
        return {"target_kv": c["target_kv"], "target_state": c["target_state"], "draft_kv": c["drafter_kv"],
                "kv_group_padding": padding_bytes(shape, buckets, s, tokens, k)}  # fmt: skip

    def act(conc: int) -> int:
        return activation_bytes(t, dm, replace(s, concurrency=conc))

    name = "dflash-bf16" if form == "bf16" else f"dflash-{d.quantized_format}"
    label = name + (" (artifact)" if form != "bf16" and d.is_quantized_artifact else "")
    src = d.source if form != "bf16" or not d.is_quantized_artifact else "dequantized size of the artifact"
    return Method(name, label, k, dm.weight_bytes, src, act, per_request, _slots(shape, s, k),
                  padding_layers(buckets))  # fmt: skip


def _no_drafter(shape: ModelShape) -> ModelSpec:
    """A stand-in drafter with no layers' cache, so `cache_bytes` prices the target alone."""
    empty = replace(shape, layer_types=(), num_layers=0)
    return ModelSpec("none", empty, 0, "bf16", "-")


# ------------------------------------------------------------------------------------------- budget


def method_required(t: ModelSpec, m: Method, s: BudgetSettings, context: int, concurrency: int) -> tuple[int, dict]:
    per = m.per_request(_tokens(s, context))
    comps = {
        "target_weights": t.weight_bytes,
        "draft_weights": m.draft_weights,
        **{key: concurrency * v for key, v in per.items()},
        "activation": m.activation(concurrency),
        "runtime_overhead": s.runtime_overhead_bytes,
        "cuda_graphs": s.cuda_graphs,
    }
    return sum(comps.values()), comps


def _max_context(t, m, s, usable, limit) -> int | None:
    fits = lambda ctx: method_required(t, m, s, ctx, s.concurrency)[0] <= usable  # noqa: E731
    if not fits(0):
        return None
    if fits(limit):
        return limit
    lo, hi = 0, limit
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def _max_concurrency(t, m, s, usable) -> int:
    fits = lambda c: method_required(t, m, s, s.context, c)[0] <= usable  # noqa: E731
    lo, hi = 0, 1
    while fits(hi) and hi < (1 << 20):
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def method_budget(t: ModelSpec, m: Method, s: BudgetSettings) -> dict:
    usable = int(s.gpu_bytes * s.utilization)
    req, comps = method_required(t, m, s, s.context, s.concurrency)
    limit = t.shape.max_position_embeddings or (1 << 24)
    per = m.per_request(_tokens(s, s.context))
    return {
        "method": m.name,
        "label": m.label,
        "spec_tokens": m.spec_tokens,
        "state_slots": m.state_slots,
        "draft_weights_source": m.draft_weights_source,
        "kv_padding_layers": {
            "/".join(str(x) for x in k if x is not None): n for k, n in m.padding_layers.items() if n
        },
        "components": comps,
        "required_bytes": req,
        "usable_bytes": usable,
        "headroom_bytes": usable - req,
        "fits": req <= usable,
        "max_context": _max_context(t, m, s, usable, limit),
        "max_concurrency": _max_concurrency(t, m, s, usable),
        "per_request": per,
        "per_request_bytes": sum(per.values()),
    }


def compare_mtp(t: ModelSpec, d: DrafterSpec, s: BudgetSettings, *, root=None, mtp_tokens=DEFAULT_MTP_TOKENS,
                mtp_weights: str | None = None) -> dict:  # fmt: skip
    """No speculation, MTP (each K), DFlash bf16 and DFlash quantized, side by side (vLLM engine)."""
    if s.engine != "vllm":
        raise UsageError(
            "--compare-mtp models vLLM only (this project's reference loop has no MTP path); drop --engine reference"
        )
    validate_settings(s)
    head = require_mtp_head(t.shape, t.label)
    w = resolve_mtp_weights(t.shape, head, root, mtp_weights)
    notes = []
    if w.file_bytes_in_target and t.weight_source == "safetensors headers":
        # the target model never loads mtp.*: vLLM's Qwen3.5 skips them and the MTP proposer loads them itself
        t = replace(t, weight_bytes=t.weight_bytes - w.file_bytes_in_target)
        notes.append("target weights exclude the checkpoint's mtp.* tensors (only the MTP method loads them)")
    methods = [no_spec_method(t, s)]
    methods += [mtp_method(t, head, w, s, k) for k in mtp_tokens]
    methods += [dflash_method(t, d, "bf16", s), dflash_method(t, d, "quantized", s)]
    budgets = {m.name: method_budget(t, m, s) for m in methods}
    base = budgets["none"]["per_request_bytes"]
    for b in budgets.values():
        b["per_request_speculation_bytes"] = b["per_request_bytes"] - base
    return {
        "engine": s.engine,
        "context": s.context,
        "concurrency": s.concurrency,
        "mtp": {
            "layers": head.num_layers,
            "dedicated_embeddings": head.dedicated_embeddings,
            "weight_bytes": w.bytes,
            "weights_from": w.source,
            "kv_bytes_per_token": mtp_kv_per_token(t.shape, head, s.kv_dtype),
        },  # fmt: skip
        "dflash_spec_tokens": s.spec_tokens,
        "methods": budgets,
        "crossover": crossovers(t, methods, s),
        "notes": notes,
    }


def crossovers(t: ModelSpec, methods: list[Method], s: BudgetSettings, limit: int = 256) -> dict:
    """For each MTP method against each DFlash method: the concurrencies where one fits and the other does not,
    and the concurrency from which the cheaper one changes (None when one is cheaper at every C <= limit)."""
    usable = int(s.gpu_bytes * s.utilization)
    out = {}
    mtps = [m for m in methods if m.name.startswith("mtp")]
    dfl = [m for m in methods if m.name.startswith("dflash")]
    for a in mtps:
        for b in dfl:
            diff = [method_required(t, a, s, s.context, c)[0] - method_required(t, b, s, s.context, c)[0]
                    for c in range(1, limit + 1)]  # fmt: skip
            change = next((c + 1 for c in range(1, len(diff)) if (diff[c] < 0) != (diff[c - 1] < 0)), None)
            ca, cb = _max_concurrency(t, a, s, usable), _max_concurrency(t, b, s, usable)
            out[f"{a.name} vs {b.name}"] = {
                "cheaper_at_1": a.name if diff[0] < 0 else b.name,
                "difference_at_1_bytes": -diff[0],
                "order_changes_at": change,
                "max_concurrency": {a.name: ca, b.name: cb},
                "only_first_fits": [cb + 1, ca] if ca > cb else None,
                "only_second_fits": [ca + 1, cb] if cb > ca else None,
            }
    return out
