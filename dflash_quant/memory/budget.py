"""Pre-deployment memory budget for a target + DFlash drafter pair on one GPU.

Plain functions over typed dataclasses; the CLI (`dflash-quant budget`) is a thin layer on top.

The model (all numbers in bytes)::

    usable            = gpu_total * gpu_memory_utilization
    allocator_peak    = target_weights + drafter_weights
                        + C * [target_kv(context) + target_state(K) + drafter_kv(context)]
                        + activation
    required          = allocator_peak + runtime_overhead + cuda_graphs
    headroom          = usable - required             (fits when >= 0)
    max_context       = largest context with required <= usable at the given concurrency
    max_concurrency   = largest C with required <= usable at the given context

Two engines are modelled:

``vllm`` (default; a serving engine with a paged cache and chunked prefill)
    - caches: context rounded up to the block size (16; hybrid targets: vLLM's larger block); full-attention
      KV for every token, sliding-window layers capped at their window, Gated DeltaNet / Mamba state with
      (1 + K) slots, (2 + K) with prefix caching (see kv.py, hybrid.py);
      the drafter's own context KV in the same cache dtype;
    - drafter weights: the packed bytes (an int4 kernel keeps them packed);
    - activation: the peak of one forward over a prefill chunk of ``prefill_chunk`` tokens (vLLM's
      ``max_num_batched_tokens``; its default is 2048 for `vllm serve` on GPUs under 70 GiB), plus the
      target's tap hidden states and the drafter's context projection for that chunk, plus fp32 logits and
      sampler copies for ``max(max_num_seqs, C*(K+1))`` rows (vLLM's profile run samples max_num_seqs
      dummy requests). See `activation_bytes` for the formula;
    - runtime overhead (default 0.75 GiB): CUDA context, cuBLAS/NCCL workspaces and other non-torch memory
      that the utilisation fraction must also cover; CUDA-graph reserve (default 0.5 GiB, 0 with
      ``enforce_eager``). Both are typical values from engine logs on 24 GB cards, not measured here:
      override them with what your engine logs. Both sit inside ``total x gpu_memory_utilization``: vLLM
      logs "model weights take X; non_torch_memory takes Y; PyTorch activation peak memory takes Z; the rest
      ... for KV Cache" summing to total x utilisation, and it subtracts its CUDA-graph estimate from the KV
      budget by default since v0.21.0 ("CUDA graph memory profiling is enabled (default since v0.21.0)",
      added by vLLM PR #30515; logged estimates 0.17-0.52 GiB on single GPUs, more with spec decoding;
      issue #50780: over-charged on hybrid GDN models since v0.26.0);
    - hybrid (Gated DeltaNet / Mamba) targets: vLLM's single page pool, its block size, 2 + K state pages
      with prefix caching (vLLM's default for hybrids) and group padding: memory/hybrid.py;
    - gpu_memory_utilization: vLLM's default 0.90.
    This engine's activation/overhead terms are *not* validated by this project (no vLLM on the test GPU).

``reference`` (this project's batch-1 loop, `dflash_quant.speculative.decode.speculative_generate` with HF models)
    - what the H200 benchmark measures (`benchmarks/bench_memory.py`);
    - caches: DynamicCache, no paging; recurrent state one slot;
    - drafter weights: what the loader holds, i.e. bf16 even for an int4 artifact (it dequantizes on load);
    - activation: the larger of (A) the target's prefill at its last layer and (B) the drafter's first
      forward over the whole prompt, both while `output_hidden_states=True` keeps every layer's hidden
      states alive; and (C) the decode steps at the full context. See `reference_activation_bytes`;
    - utilisation 1.0, no CUDA graphs; runtime overhead as above (it is outside the allocator peak).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from dflash_quant.errors import DFlashQuantError, UsageError
from dflash_quant.io.weights import tensor_entries, weight_files
from dflash_quant.memory.engine import (
    ACT_BYTES,
    LOGITS_COPIES,
    drafter_layer_keys,
    kv_buckets,
    layer_peak,
    padding_bytes,
    round_up,
)
from dflash_quant.memory.gpus import GiB, MiB, parse_bytes
from dflash_quant.memory.hybrid import hybrid_layout
from dflash_quant.memory.kv import (
    ModelShape,
    dtype_bytes,
    kv_per_token,
    parse_shape,
    read_config,
    recurrent_state_bytes,
)
from dflash_quant.memory.presets import load_preset, preset_names
from dflash_quant.memory.weights import (
    WEIGHT_FORMATS,
    count_params,
    priced_bytes,
    priced_drafter_parts,
    weights_from_files,
)
from dflash_quant.models.config_check import check_layers_present
from dflash_quant.reference import pair_dir, parse_shipped, shipped_id

ENGINES = ("vllm", "reference")
DEFAULT_UTILIZATION = {"vllm": 0.90, "reference": 1.0}
DEFAULT_RUNTIME_OVERHEAD = int(0.75 * GiB)
DEFAULT_CUDA_GRAPHS = {"vllm": int(0.5 * GiB), "reference": 0}
DEFAULT_PREFILL_CHUNK = 2048  # vLLM max_num_batched_tokens for `vllm serve` on GPUs < 70 GiB
DEFAULT_MAX_NUM_SEQS = 256  # vLLM max_num_seqs default on GPUs < 70 GiB
DEFAULT_BLOCK_SIZE = 16
# torch allocates the cuBLAS workspace through its caching allocator on the first matmul, so it shows in
# the allocator peak: CUBLAS_WORKSPACE_CONFIG's default on Hopper is :4096:8 = 32 MiB (see PyTorch's
# cuBLAS notes); older GPUs use less. The reference engine counts it; vLLM's overhead term already does.
DEFAULT_CUBLAS_WORKSPACE = 32 * MiB


# ------------------------------------------------------------------------------------------- inputs


@dataclass(frozen=True)
class ModelSpec:
    """One model as the budget sees it: its shape and the bytes its weights take resident."""

    label: str
    shape: ModelShape
    weight_bytes: int
    weight_format: str
    weight_source: str


@dataclass(frozen=True)
class DrafterSpec:
    """A drafter in both forms, so that the budget can show what quantizing it buys."""

    label: str
    shape: ModelShape
    bf16_bytes: int
    quantized_bytes: int
    quantized_format: str  # "int4" (GPTQ g128), or what the artifact holds
    source: str
    is_quantized_artifact: bool = False
    bf16_parts: dict = field(default_factory=dict)  # bytes per drafter part (weights.DRAFTER_PARTS)
    quantized_parts: dict = field(default_factory=dict)

    def as_model(self, form: str) -> ModelSpec:
        if form == "bf16":
            return ModelSpec(self.label, self.shape, self.bf16_bytes, "bf16", self.source)
        return ModelSpec(self.label, self.shape, self.quantized_bytes, self.quantized_format, self.source)


@dataclass(frozen=True)
class BudgetSettings:
    gpu_name: str
    gpu_bytes: int
    context: int
    concurrency: int = 1
    spec_tokens: int = 15
    engine: str = "vllm"
    kv_dtype: str | None = None  # None: the model's dtype
    drafter_kv_dtype: str | None = None  # None: same as kv_dtype
    state_dtype: str | None = None  # recurrent state; None: config's mamba_ssm_dtype, else model dtype
    gpu_memory_utilization: float | None = None  # None: engine default
    runtime_overhead_bytes: int = DEFAULT_RUNTIME_OVERHEAD
    cuda_graph_bytes: int | None = None  # None: engine default
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    block_size: int = DEFAULT_BLOCK_SIZE
    activation_bytes: int | None = None  # override the estimate
    new_tokens: int = 0  # reference engine: tokens generated after a prompt of (context - new_tokens)
    cublas_workspace_bytes: int = DEFAULT_CUBLAS_WORKSPACE  # reference engine on CUDA; 0 on CPU
    # vllm, hybrid targets: prefix caching (on by default since vLLM PR #50991, `align` mode) keeps one more
    # state page per request than `--no-enable-prefix-caching` (see memory/hybrid.py)
    prefix_caching: bool = True

    @property
    def utilization(self) -> float:
        u = self.gpu_memory_utilization
        return DEFAULT_UTILIZATION[self.engine] if u is None else u

    @property
    def cuda_graphs(self) -> int:
        return DEFAULT_CUDA_GRAPHS[self.engine] if self.cuda_graph_bytes is None else self.cuda_graph_bytes


def validate_settings(s: BudgetSettings) -> None:
    if s.engine not in ENGINES:
        raise UsageError(f"unknown engine {s.engine!r}; use one of {', '.join(ENGINES)}")
    if s.context < 0:
        raise UsageError(f"--context must not be negative (got {s.context})")
    if s.concurrency < 1:
        raise UsageError(f"--concurrency must be at least 1 (got {s.concurrency})")
    if s.spec_tokens < 0:
        raise UsageError(f"--spec-tokens must not be negative (got {s.spec_tokens})")
    if not 0 < s.utilization <= 1:
        raise UsageError(f"--gpu-memory-utilization must be in (0, 1] (got {s.utilization})")
    if s.prefill_chunk < 1 or s.block_size < 1 or s.max_num_seqs < 1:
        raise UsageError("--prefill-chunk, --block-size and --max-num-seqs must be positive")
    if s.engine == "reference" and s.concurrency != 1:
        raise UsageError("the reference loop decodes one request at a time; use --concurrency 1 or --engine vllm")
    if not 0 <= s.new_tokens <= s.context:
        raise UsageError(f"--new-tokens must be in [0, context] (got {s.new_tokens} for context {s.context})")


# ----------------------------------------------------------------------------------- model resolution


def load_config(spec: str | Path | dict) -> tuple[dict, Path | None, str]:
    """(config dict, directory with weights or None, label) from a preset name, directory or config.json."""
    if isinstance(spec, dict):
        return spec, None, str(spec.get("_preset", "config"))
    text = str(spec)
    preset = load_preset(text)
    if preset is not None:
        return preset, None, f"preset:{text.lower()}"

    shipped = parse_shipped(text)
    if shipped:  # a shipped pair's part, by its name (`reference:target`)
        path = pair_dir(shipped[0]) / shipped[1]
        return read_config(path), path, shipped_id(*shipped)
    path = Path(text).expanduser()
    if path.is_dir():
        return read_config(path), path, str(path)
    if path.is_file():
        return read_config(path), None, str(path)
    raise DFlashQuantError(
        f"{text!r} is not a preset, a directory or a config.json; use one of {', '.join(preset_names())} or a path"
    )


def _check_layers(shape: ModelShape, root: Path | None, label: str, exact: bool) -> None:
    """The config's layer count against the weights beside it (headers only), like the loader does."""

    if root is None:
        return
    names = list(tensor_entries(root, required=False))
    names = [n[len("model.") :] if shape.is_drafter and n.startswith("model.") else n for n in names]
    check_layers_present(shape.num_layers, names, label, exact=exact)


def resolve_target(spec: str | Path | dict, weights: str | None = None, *, engine: str = "vllm") -> ModelSpec:
    """Target from a preset / dir / config.json; weights from files when present, else counted from the config.

    weights: None (files, else the config's dtype), a format (bf16|fp16|fp8|int8|int4), or a size ('17.8GB').
    """
    cfg, root, label = load_config(spec)
    shape = parse_shape(cfg, source=label)
    _check_layers(shape, root, label, exact=False)
    if shape.is_drafter:
        raise UsageError(f"{label} is a DFlash drafter config; pass the target model with --target")
    if weights:
        w = str(weights).strip().lower()
        if w in WEIGHT_FORMATS:
            return ModelSpec(label, shape, priced_bytes(count_params(shape), w), w, f"counted from config at {w}")
        try:
            given = parse_bytes(weights, what="--target-weights")
        except UsageError:
            raise UsageError(
                f"unknown --target-weights {weights!r}; use {'|'.join(WEIGHT_FORMATS)} or a size like 17.8GB"
            ) from None
        return ModelSpec(label, shape, given, "given", "given")
    if root is not None and weight_files(root, required=False):
        rep = weights_from_files(root)
        fmt = "quantized" if rep.quantized_linears else "files"
        return ModelSpec(label, shape, rep.total_bytes, fmt, "safetensors headers")
    q = shape.quantization or {}
    if q.get("bits") in (4, 8) and engine != "reference":
        fmt = f"int{q['bits']}"
        return ModelSpec(label, shape, priced_bytes(count_params(shape), fmt), fmt, "counted from config")
    fmt = "fp16" if "16" in shape.dtype and "b" not in shape.dtype else "bf16"
    return ModelSpec(label, shape, priced_bytes(count_params(shape), fmt), fmt, f"counted from config at {fmt}")


def resolve_drafter(spec: str | Path | dict, *, group_size: int = 128) -> DrafterSpec:
    """Drafter from an artifact dir (packed bytes from files), a bf16 drafter dir, a config.json or a preset."""
    cfg, root, label = load_config(spec)
    shape = parse_shape(cfg, source=label)
    _check_layers(shape, root, label, exact=True)
    if group_size != -1 and group_size < 1:
        raise UsageError(f"--group-size {group_size} is invalid; use -1 (per channel) or a positive width like 128")
    if not shape.is_drafter:
        raise UsageError(
            f"{label} is not a DFlash drafter config (no dflash_config/target_layer_ids); pass it with --target"
        )
    pc = count_params(shape)
    est_int4 = priced_bytes(pc, "int4", group_size)
    est_bf16 = priced_bytes(pc, "bf16")
    # by part (backbone, fc, norms, DFlash2 conv / codebooks / selector projection): files where we have them
    parts_bf16, parts_int4 = priced_drafter_parts(pc, "bf16"), priced_drafter_parts(pc, "int4", group_size)
    if root is not None and weight_files(root, required=False):
        rep = weights_from_files(root)
        if rep.quantized_linears:
            bits = int((shape.quantization or {}).get("bits", 4))
            return DrafterSpec(label, shape, rep.dequantized_bf16_bytes, rep.total_bytes, f"int{bits}",
                               "safetensors headers (quantized artifact)", True, parts_bf16, rep.by_part)  # fmt: skip
        return DrafterSpec(label, shape, rep.total_bytes, est_int4, "int4", "safetensors headers; int4 = GPTQ g128 estimate",
                           False, rep.by_part, parts_int4)  # fmt: skip
    return DrafterSpec(label, shape, est_bf16, est_int4, "int4", "counted from config; int4 = GPTQ g128 estimate",
                       False, parts_bf16, parts_int4)  # fmt: skip


# ------------------------------------------------------------------------------------------- caches


def cache_bytes(target: ModelSpec, drafter: ModelSpec, s: BudgetSettings, context: int) -> dict[str, int]:
    """Per-request caches at `context` tokens (target KV, target recurrent state, drafter context KV)."""
    if s.engine == "vllm" and target.shape.recurrent is not None:
        return _hybrid_cache_bytes(target, drafter, s, context)
    tokens = round_up(context, s.block_size) if s.engine == "vllm" else context
    t_kv = kv_per_token(target.shape, s.kv_dtype).bytes_for(tokens)
    d_kv = kv_per_token(drafter.shape, s.drafter_kv_dtype or s.kv_dtype).bytes_for(tokens)
    slots_k = s.spec_tokens if s.engine == "vllm" else 0
    state = recurrent_state_bytes(target.shape, slots_k, ssm_dtype=s.state_dtype)
    return {"target_kv": t_kv, "target_state": state, "drafter_kv": d_kv}


def _hybrid_cache_bytes(target: ModelSpec, drafter: ModelSpec, s: BudgetSettings, context: int) -> dict[str, int]:
    """vLLM's one page pool for a hybrid target: large blocks, padded state pages, 1 or 2 + K state slots
    (memory/hybrid.py has the rules and their sources; group padding is `kv_group_padding`)."""
    lay = layout(target, s)
    r = target.shape.recurrent
    assert r is not None
    tokens = round_up(context, lay.block_tokens)
    t_kv = kv_per_token(target.shape, s.kv_dtype).bytes_for(tokens)
    d_kv = kv_per_token(drafter.shape, s.drafter_kv_dtype or s.kv_dtype).bytes_for(tokens)
    return {"target_kv": t_kv, "target_state": r.num_layers * lay.state_bytes_per_layer, "drafter_kv": d_kv}


def layout(target: ModelSpec, s: BudgetSettings):
    return hybrid_layout(
        target.shape, kv_dtype=s.kv_dtype, state_dtype=s.state_dtype, spec_tokens=s.spec_tokens,
        prefix_caching=s.prefix_caching,
    )  # fmt: skip


def group_padding_bytes(target: ModelSpec, drafter: ModelSpec, s: BudgetSettings, context: int) -> int:
    """Per-request bytes of vLLM's padding layers (memory/mtp.py: buckets by KV spec, groups of one size)."""

    if target.shape.recurrent is None:
        return 0  # one attention spec per model: vLLM pads only the hybrid pool's buckets here
    buckets = kv_buckets(target.shape, drafter_layer_keys(drafter.shape) if drafter.shape.num_layers else [])
    return padding_bytes(target.shape, buckets, s, context, s.spec_tokens)


# --------------------------------------------------------------------------------------- activations


def activation_bytes(target: ModelSpec, drafter: ModelSpec, s: BudgetSettings) -> int:
    """vLLM-style activation peak (see the module docstring).

    T = prefill_chunk tokens:
      target layer peak          max(attention, MLP, linear-attention) transients + 2 T H a
      tap hidden states          n_taps T H a
      drafter context projection T H a (fc out) + T H 4 (norm in fp32) + 2 T kv_heads head_dim a
      logits + sampler           max(max_num_seqs, C (K+1)) V 4 x 3   (fp32 logits, probs, one temporary)
      drafter block forward      C B (H + 3 I_d) a
    """
    if s.activation_bytes is not None:
        return s.activation_bytes
    t, d = target.shape, drafter.shape
    a = ACT_BYTES
    tok = s.prefill_chunk
    hd = d.hidden_size
    taps = max(d.num_taps, 1) * tok * t.hidden_size * a
    ctx_proj = tok * hd * a + tok * hd * 4 + 2 * tok * d.num_kv_heads * d.head_dim * a
    rows = max(s.max_num_seqs, s.concurrency * (s.spec_tokens + 1))
    logits = rows * t.vocab_size * 4 * LOGITS_COPIES
    block = (d.block_size or s.spec_tokens + 1) * s.concurrency
    draft_fwd = block * (hd + 3 * d.intermediate_size) * a
    return layer_peak(t, tok) + taps + ctx_proj + logits + draft_fwd


def reference_activation_bytes(
    target: ModelSpec, drafter: ModelSpec, s: BudgetSettings, context: int
) -> dict[str, int]:
    """Activation peak of `speculative_generate` (batch 1, HF target, bf16), by phase. P = context - new_tokens.

    (A) target prefill, at the last layer:
        L P H a            inputs of every layer, kept because output_hidden_states=True
        + P H a            the attention residual sum
        + max( P H a + P (Q + 2 kvd) a + 2 P Q 4        attention: normed input, q/k/v, q_norm in fp32
             , P H a + 3 P I a )                        MLP: normed input, gate/up/act*up
    (B) drafter's first forward over the P prompt rows, while the prefill output is still referenced:
        (L+1) P H a        all hidden states of the prefill
        + n_taps P H a     the concatenated taps (ctx)
        + P H a            fc + hidden_norm output
        + max( P H a + 2 P H 4                          fc output, hidden_norm in fp32
             , (P+B) H a + 4 P kvd_d a + 2 P kvd_d 4 )  kv_in concat, k/v projections, rope, k_norm in fp32
        (the drafter's context KV for P rows is counted in the caches)
    (C) a decode step at the full context: (L+1) B H a + B V (a + 4)   (verify hidden states, logits + probs)
    a = 2 (bf16), Q = heads * head_dim, kvd = kv_heads * head_dim, B = block size.
    """
    t, d = target.shape, drafter.shape
    a = ACT_BYTES
    p = context - s.new_tokens
    h, L = t.hidden_size, t.num_layers
    q = t.num_attention_heads * t.head_dim * (2 if t.attn_output_gate else 1)
    kvd = t.num_kv_heads * t.head_dim
    attn = p * h * a + p * (q + 2 * kvd) * a + 2 * p * q * 4
    mlp = p * h * a + 3 * p * t.intermediate_size * a
    phase_a = L * p * h * a + p * h * a + max(attn, mlp)
    b = d.block_size or (s.spec_tokens + 1)
    hd = d.hidden_size
    kvd_d = d.num_kv_heads * d.head_dim
    drafter_tmp = max(p * hd * a + 2 * p * hd * 4, (p + b) * hd * a + 4 * p * kvd_d * a + 2 * p * kvd_d * 4)
    phase_b = (L + 1) * p * h * a + max(d.num_taps, 1) * p * h * a + p * hd * a + drafter_tmp
    phase_c = (L + 1) * b * h * a + b * t.vocab_size * (a + 4)
    return {"prefill": phase_a, "drafter_prefill": phase_b, "decode": phase_c}


# -------------------------------------------------------------------------------------------- budget


@dataclass
class Budget:
    engine: str
    gpu: str
    gpu_bytes: int
    utilization: float
    usable_bytes: int
    context: int
    concurrency: int
    spec_tokens: int
    drafter_form: str
    components: dict[str, int]
    allocator_peak_bytes: int
    required_bytes: int
    headroom_bytes: int
    fits: bool
    drafter_room_bytes: int  # usable - required + the drafter's weights: what `gptq --fit` sizes the drafter to
    max_context: int | None
    max_context_limited_by: str
    max_concurrency: int
    notes: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        return asdict(self)


def reference_phases(
    target: ModelSpec, drafter: ModelSpec, s: BudgetSettings, context: int
) -> dict[str, dict[str, int]]:
    """Reference loop: caches + activation of each phase (prefill, drafter_prefill, decode), weights excluded."""
    p = context - s.new_tokens
    prompt = cache_bytes(target, drafter, s, p)
    full = cache_bytes(target, drafter, s, context)
    act = reference_activation_bytes(target, drafter, s, context)
    if s.activation_bytes is not None:
        act = {k: s.activation_bytes for k in act}
    return {
        "prefill": {**prompt, "drafter_kv": 0, "activation": act["prefill"]},
        "drafter_prefill": {**prompt, "activation": act["drafter_prefill"]},
        "decode": {**full, "activation": act["decode"]},
    }


def peak_phase(phases: dict[str, dict[str, int]]) -> str:
    return max(phases, key=lambda k: sum(phases[k].values()))


def required_bytes(
    target: ModelSpec, drafter: ModelSpec, s: BudgetSettings, context: int, concurrency: int
) -> tuple[int, dict[str, int]]:
    """(required bytes, components) at this context and concurrency."""
    weights = {"target_weights": target.weight_bytes, "drafter_weights": drafter.weight_bytes}
    caches = cache_bytes(target, drafter, s, context)
    if s.engine == "reference":
        # batch 1; the peak is the largest of three phases, each with the caches that exist at that moment
        phases = reference_phases(target, drafter, s, context)
        comps: dict[str, int] = {**weights, **phases[peak_phase(phases)], "cublas_workspace": s.cublas_workspace_bytes}
    else:
        comps = {
            **weights,
            "target_kv": concurrency * caches["target_kv"],
            "target_state": concurrency * caches["target_state"],
            "drafter_kv": concurrency * caches["drafter_kv"],
            "kv_group_padding": concurrency * group_padding_bytes(target, drafter, s, context),
            "activation": activation_bytes(target, drafter, replace(s, concurrency=concurrency)),
        }
    comps["runtime_overhead"] = s.runtime_overhead_bytes
    comps["cuda_graphs"] = s.cuda_graphs
    return sum(comps.values()), comps


def allocator_peak(comps: dict[str, int]) -> int:
    return sum(v for k, v in comps.items() if k not in ("runtime_overhead", "cuda_graphs"))


def _max_context(target, drafter, s, usable, limit) -> int | None:
    if required_bytes(target, drafter, s, 0, s.concurrency)[0] > usable:
        return None
    lo, hi = 0, limit
    if required_bytes(target, drafter, s, hi, s.concurrency)[0] <= usable:
        return hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if required_bytes(target, drafter, s, mid, s.concurrency)[0] <= usable:
            lo = mid
        else:
            hi = mid
    return lo


def _max_concurrency(target, drafter, s, usable) -> int:
    if s.engine == "reference":
        return 1 if required_bytes(target, drafter, s, s.context, 1)[0] <= usable else 0
    lo, hi = 0, 1
    while required_bytes(target, drafter, s, s.context, hi)[0] <= usable and hi < (1 << 20):
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if required_bytes(target, drafter, s, s.context, mid)[0] <= usable:
            lo = mid
        else:
            hi = mid
    return lo


def compute_budget(target: ModelSpec, drafter: ModelSpec, s: BudgetSettings, drafter_form: str = "") -> Budget:
    validate_settings(s)
    usable = int(s.gpu_bytes * s.utilization)
    req, comps = required_bytes(target, drafter, s, s.context, s.concurrency)
    model_max = target.shape.max_position_embeddings
    limit = model_max if model_max else 1 << 24
    if s.engine == "reference":
        s_ctx = replace(s, new_tokens=0)
    else:
        s_ctx = s
    mc = _max_context(target, drafter, s_ctx, usable, limit)
    limited = "memory"
    if mc is not None and mc == limit:
        limited = "max_position_embeddings" if model_max else "search limit"
    notes = []
    if s.engine == "vllm" and target.shape.recurrent is not None:
        slots = layout(target, s).state_slots
        why = "2 + K: prefix caching on, vLLM's default" if s.prefix_caching else "1 + K: --no-enable-prefix-caching"
        notes.append(f"linear-attention state kept in {slots} slots per request ({why})")
    if s.engine == "reference":
        phase = peak_phase(reference_phases(target, drafter, s, s.context))
        notes.append(f"reference loop: peak in the {phase.replace('_', ' ')} phase")
    if s.engine == "reference" and drafter_form not in ("", "bf16"):
        notes.append("the reference loop dequantizes a quantized drafter to bf16 on load: same bytes as bf16")
    return Budget(
        engine=s.engine,
        gpu=s.gpu_name,
        gpu_bytes=s.gpu_bytes,
        utilization=s.utilization,
        usable_bytes=usable,
        context=s.context,
        concurrency=s.concurrency,
        spec_tokens=s.spec_tokens,
        drafter_form=drafter_form or drafter.weight_format,
        components=comps,
        allocator_peak_bytes=allocator_peak(comps),
        required_bytes=req,
        headroom_bytes=usable - req,
        fits=req <= usable,
        drafter_room_bytes=usable - req + comps["drafter_weights"],
        max_context=mc,
        max_context_limited_by=limited if mc is not None else "weights and fixed costs exceed the GPU",
        max_concurrency=_max_concurrency(target, drafter, s, usable),
        notes=notes,
    )


def compare_drafters(target: ModelSpec, drafter: DrafterSpec, s: BudgetSettings) -> dict[str, Budget]:
    """The same budget with the bf16 drafter and with the quantized one."""
    out = {"bf16": compute_budget(target, drafter.as_model("bf16"), s, "bf16")}
    q = drafter.as_model("quantized")
    if s.engine == "reference":
        q = replace(q, weight_bytes=drafter.bf16_bytes)
    out[drafter.quantized_format] = compute_budget(target, q, s, drafter.quantized_format)
    return out


def kv_summary(target: ModelSpec, drafter: ModelSpec | DrafterSpec, s: BudgetSettings) -> dict:
    """Per-token and per-request cache facts for the report."""
    tk = kv_per_token(target.shape, s.kv_dtype)
    dk = kv_per_token(drafter.shape, s.drafter_kv_dtype or s.kv_dtype)
    k = s.spec_tokens if s.engine == "vllm" else 0
    r = target.shape.recurrent
    return {
        "target_kv_bytes_per_token": tk.uncapped_bytes,
        "target_full_attention_bytes_per_token": tk.full_bytes,
        "target_sliding_bytes_per_token": tk.sliding_bytes,
        "target_sliding_window": tk.window,
        "target_state_bytes_per_request": (
            cache_bytes(
                target, ModelSpec("none", replace(drafter.shape, layer_types=(), num_layers=0), 0, "bf16", "-"), s, 0
            )["target_state"]
        ),  # fmt: skip
        "target_state_slots": ((2 if s.prefix_caching and s.engine == "vllm" else 1) + k) if r else 0,
        "target_state_dtype": (s.state_dtype or (r.ssm_dtype if r else None) or target.shape.dtype) if r else None,
        "drafter_kv_bytes_per_token": dk.uncapped_bytes,
        "drafter_sliding_window": dk.window,
        "kv_dtype": s.kv_dtype or target.shape.dtype,
        "kv_bytes_per_element": dtype_bytes(s.kv_dtype or target.shape.dtype),
    }
