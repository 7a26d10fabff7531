# ruff: noqa: RUF009  (doc() returns a dataclasses.field, which ruff cannot see)
"""The artifact's reports (docs/artifact.md is generated from these classes: dflash_quant.artifact.docgen)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from dflash_quant.artifact.schema import Record, ReportFile, doc

REEXPORT = "re-export the artifact with `dflash-quant gptq`"
E = dict  # extra: unknown keys, written back as read


# ------------------------------------------------------------------------------------------ provenance


@dataclass
class SourceRef(Record):
    id: str | None = doc(
        "Hub id (`org/name`), shipped pair part (`reference`, `reference:target`), or a local "
        "directory relative to the working directory (else its name); never an absolute path"
    )
    kind: str | None = doc("`hub`, `shipped` (inside the installed dflash_quant/reference/ package) or `local`")
    revision: str | None = doc("Hub commit or branch the files came from (null for shipped and local sources)")
    sha256: str | None = doc("sha256 of the weight files (*.safetensors, index order), concatenated")
    path: str | None = doc(
        "local sources: the directory relative to the working directory (else its name)", omit_none=True
    )
    hub_id: str | None = doc("the source's Hub id when it is known apart from `id`", omit_none=True)
    license: str | None = doc(
        "license to inherit in the card when the source's own card is not available", omit_none=True
    )
    extra: E = doc("", factory=dict)

    def recorded_spec(self) -> str | None:
        """What to pass to the loader to get this model again (a recorded local directory when it exists here)."""
        from pathlib import Path

        if self.path and Path(self.path).is_dir():
            return self.path
        return self.id

    def hub_repo(self) -> str | None:
        """The Hub repo this came from, only for Hub sources (shipped and local ones have none)."""
        if self.kind == "hub":
            return self.hub_id or self.id
        if self.kind is None:  # written before `kind` existed: trust only an explicit hub_id
            return self.hub_id
        return None


@dataclass
class CalibrationMemory(Record):
    """Peak memory of calibration: predicted by dflash_quant.memory.calibration, and measured."""

    predicted_peak_bytes: int | None = doc("formula: weights + Hessians + KV cache + kept hidden states + transients")
    predicted_resident_bytes: int | None = doc("the same without the per-forward transients (what CPU tracking sees)")
    predicted: dict[str, int] | None = doc("the formula's terms in bytes, by name")
    measured_bytes: int | None = doc("measured peak (see `measured_kind`)")
    measured_kind: str | None = doc(
        "`cuda_max_memory_allocated` (torch allocator peak, summed over the GPUs used) or `cpu_tracked_tensors` "
        "(bytes of the tensors the run can account for: weights, Hessians, replay, and the largest target "
        "forward's outputs and KV cache; not the process RSS)"
    )
    measured_by_device: dict[str, int] | None = doc("measured peak per device", omit_none=True)
    ratio: float | None = doc("measured / predicted (predicted_peak on GPU, predicted_resident on CPU)")
    extra: E = doc("", factory=dict)


@dataclass
class TargetPlacement(Record):
    """Where a target split by --device-map landed."""

    device_map: Any = doc("--device-map as given: a strategy name or {module: device}")
    max_memory: dict[str, str] | None = doc("--max-memory per device", omit_none=True)
    resolved: dict[str, str] | None = doc("module -> device after loading (transformers' hf_device_map)")
    weight_bytes: dict[str, int] | None = doc("target weight bytes per device (`disk`: read on use)")
    streamed_bytes: dict[str, int] | None = doc(
        "weight bytes accelerate copies onto the execution device for every target forward, by source: `host` "
        "(of which `pinned`: page-locked) and `disk`; a tied weight counts once per module that reads it",
        omit_none=True,
    )
    extra: E = doc("", factory=dict)


@dataclass
class Calibration(Record):
    prompts: str | None = doc(
        "prompt set (`builtin:calib`, `reference:calib`, or a file relative to the working directory)"
    )
    num_prompts: int | None = doc("prompts used")
    max_new_tokens: int | None = doc("tokens generated per prompt while capturing")
    kv_hessian: str | None = doc("`block` or `block+context`: rows in the k/v Hessians")
    rows: dict[str, int] | None = doc("Hessian rows per input group")
    steps: int | None = doc("speculative steps captured")
    mean_tau_bf16: float | None = doc("tau of the bf16 drafter during calibration")
    seed: int | None = doc("seed")
    chat_template: bool | None = doc("prompts wrapped in the tokenizer's chat template")
    cached: bool | None = doc("statistics reused from --calib-cache or the calibration store")
    store: str | None = doc(
        "calibration store (~/.cache/dflash-quant/calib): `hit`, `stored`, or `not stored: <why>` (absent "
        "with --no-calib-cache or --calib-cache)",
        omit_none=True,
    )
    resumed_prompts: int | None = doc(
        "prompts taken from an interrupted run's checkpoint (--calib-checkpoint-every) instead of recomputed",
        omit_none=True,
    )
    hessian_device: str | None = doc("device the Hessians were accumulated on (--hessian-device)", omit_none=True)
    batch_rows: int | None = doc(
        "prompts decoded as rows of one batch while capturing (--calib-batch; padding rows never reach a Hessian)",
        omit_none=True,
    )
    teacher_forced: bool | None = doc(
        "the target's side of the loop came from one batched greedy decode (--teacher-forced)", omit_none=True
    )
    target_placement: TargetPlacement | None = doc("the target's --device-map split, if any", omit_none=True)
    memory: CalibrationMemory | None = doc("calibration peak memory, predicted and measured", omit_none=True)
    extra: E = doc("", factory=dict)


@dataclass
class Quantization(Record):
    method: str | None = doc(
        "`gptq`, `gptq-kl` (GPTQ, then scales and codes tuned on the drafter's KL and the target's tokens) or `rtn`"
    )
    bits: int | None = doc("2, 3, 4 or 8")
    group_size: int | None = doc("-1 (per channel) or the group size")
    sym: bool | None = doc("symmetric grid")
    desc_act: bool | None = doc("act-order")
    static_groups: bool | None = doc("group parameters fixed before reordering")
    clip_search: bool | None = doc("each group's range shrunk by its weighted-error-optimal factor (--clip-search)")
    damp: float | None = doc("dampening (fraction of the mean Hessian diagonal)")
    lazy_block: int | None = doc("columns per lazy-batch update")
    sequential: bool | None = doc("stage-by-stage quantization with quantized inputs")
    profile: str | None = doc("`full`, `vllm` or `sglang`")
    skip: list[str] | None = doc("--skip regexes")
    min_rows: int | None = doc("fewest calibration rows accepted per layer")
    skipped: list[str] | None = doc("Linears kept in bf16")
    tune_epochs: int | None = doc("gptq-kl: passes over the recorded calibration inputs", omit_none=True)
    tune_lr: float | None = doc("gptq-kl: Adam step on each group's log scale", omit_none=True)
    tune_codes: bool | None = doc("gptq-kl: codes could move one step", omit_none=True)
    tune_code_travel: float | None = doc(
        "gptq-kl: code steps each code offset may travel over the tuning (each step: this / steps)", omit_none=True
    )
    tune_anchor: float | None = doc(
        "gptq-kl: weight of the Hessian-weighted error to the bf16 weights in the loss (0: KL alone)", omit_none=True
    )
    tune_norms: bool | None = doc("gptq-kl: the RMSNorm weights were tuned too", omit_none=True)
    tune_position_decay: float | None = doc(
        "gptq-kl: block position k's KL weighs exp(-(k-1)/decay) (0: every position weighs 1)", omit_none=True
    )
    tune_rows: str | None = doc(
        "gptq-kl: the block rows scored (all, or those the bf16 drafter reaches)", omit_none=True
    )
    tune_target: float | None = doc(
        "gptq-kl: weight of the cross-entropy to the target's token in the loss (0: KL alone)", omit_none=True
    )
    extra: E = doc("", factory=dict)


@dataclass
class FitServing(Record):
    """`gptq --fit`: the serving settings the drafter was sized for (dflash_quant/memory/fit.py)."""

    gpu: str | None = doc("card name")
    context: int | None = doc("tokens per request")
    target_weights: str | None = doc("the target's weight form in the budget")
    settings: dict[str, Any] | None = doc(
        "spec_tokens, kv_dtype, drafter_kv_dtype, state_dtype, prefix_caching, gpu_memory_utilization, "
        "cuda_graph_bytes the budget was computed with (`dflash-quant budget` with the same flags agrees)"
    )
    changed: list[str] | None = doc("what the search changed from the given settings; empty: they fit as given")
    drafter_room: int | None = doc("bytes the drafter's weights may take at these settings")
    usable_bytes: int | None = doc("GPU bytes x gpu_memory_utilization")
    required_without_drafter: int | None = doc("what the budget requires with a weightless drafter")
    given_room: int | None = doc("room at the settings as given (negative: they leave none)")
    engine_flags: list[str] | None = doc("`vllm serve` flags to serve with these settings")
    tried: int | None = doc("candidate settings evaluated")
    notes: list[str] | None = doc("caveats")
    tau_bf16_at_k: float | None = doc("tau of the bf16 drafter capped at this K, from dev-prompt acceptance lengths")
    tau_bf16_at_k_measured: float | None = doc(
        "tau of the bf16 drafter decoding the dev prompts with K drafted tokens (a K + 1 block), measured"
    )
    tau_bf16_full: float | None = doc("tau of the bf16 drafter at its full block on the same prompts")
    predicted_tau: float | None = doc("tau_bf16_at_k x the mix's predicted tau ratio")
    options: list[dict] | None = doc("per K: the settings considered, room and predicted tau")
    extra: E = doc("", factory=dict)


@dataclass
class Mixed(Record):
    goal: str | None = doc(
        "`max_tau_loss`, `max_bytes`, `max_bits_per_weight` or `fit` (the gptq flag that asked for the mix)"
    )
    goal_value: str | None = doc("the flag's value (tau loss, bytes, or GPU and context for `fit`)")
    byte_budget: int | None = doc(
        "bytes the quantized Linears may take (max_bytes / max_bits_per_weight / fit); null for max_tau_loss"
    )
    loss_budget: float | None = doc("summed relative output error allowed (max_tau_loss, from the tau calibration)")
    candidates: list[str] | None = doc("settings searched per Linear, `bits/group_size[+act][+clip]`")
    picks: dict[str, str] | None = doc(
        "the chosen setting per Linear, `bits/group_size`, with `+act` (act-order, static groups) / `+clip` "
        "(clip search) for how GPTQ solved it"
    )
    predicted_bytes: int | None = doc("GPTQ v1 bytes of the quantized Linears at the picks")
    bits_per_weight: float | None = doc(
        "the picks' bits per weight in codes, scales and zeros (g_idx, one int32 per input column, not counted)"
    )
    predicted_loss: float | None = doc("summed relative output error at the picks (calibration rows)")
    predicted_tau_ratio: float | None = doc("tau ratio the tau calibration predicts for that loss")
    predicted_tau_ratio_low: float | None = doc(
        "the tau ratio predicted with the slope's upper bound (`slope_bounds`): the conservative prediction"
    )
    slope_bounds: list[float] | None = doc(
        "one-sided 95 % lower and upper bounds of the tau map's slope, paired bootstrap over the dev prompts "
        "(max_tau_loss's loss budget uses the upper one)"
    )
    bits_floor: int | None = doc(
        "max_tau_loss: the smallest uniform bit width whose tau loss at the lower slope bound keeps the goal "
        "(gptq-kl: whose tuned uniform drafter's own measured tau loss has a lower bound keeping it); no Linear goes "
        "below it"
    )
    notes: list[str] | None = doc("caveats of the plan (max_tau_loss: dev prompts too few to resolve the goal)")
    solver_slopes: dict[str, list[float]] | None = doc(
        "max_tau_loss: per solver kind (`plain`, `tuned` = act-order and/or clip search, `kl` = tuned after GPTQ "
        "by gptq-kl) [lower bound, fitted, upper bound] of the map's slope; each Linear's loss counts at its kind's "
        "upper slope in the plan and at its fitted slope in predicted_tau_ratio (a gptq-kl mix: every Linear at kl's, "
        "fitted on the tuned points at or above bits_floor)"
    )
    tau_calibration: list[dict] | None = doc(
        "uniform settings measured on the development prompts: loss, tau, tau ratio (the loss -> tau map); a "
        "gptq-kl max_tau_loss plan adds each tuned point's one-sided 95 % tau-loss bounds (`tau_loss_bounds`)"
    )
    dev_prompts: str | None = doc("development prompts of the tau calibration (calibration prompts, first N)")
    uniform: list[dict] | None = doc("each uniform candidate's bytes and summed loss, for comparison")
    nearest_uniform: str | None = doc("the smallest uniform setting at least as large as the mix (`bits/group_size`)")
    vllm_fused_conflicts: list[str] | None = doc("vLLM fused modules (qkv_proj, gate_up_proj) whose parts differ")
    seconds: dict[str, float] | None = doc("table, tau calibration and search time")
    serving: FitServing | None = doc("`fit` only: the serving settings and engine flags the drafter was sized for")
    extra: E = doc("", factory=dict)


@dataclass
class TargetQuantization(Record):
    format: str | None = doc("`pack-quantized` (compressed-tensors), `gptq` or `awq`; null for a dense target")
    quant_method: str | None = doc("the checkpoint's quantization_config.quant_method")
    bits: int | None = doc("weight bits")
    group_size: int | None = doc("-1 (per channel) or the group size")
    symmetric: bool | None = doc("symmetric grid")
    packed_linears: int | None = doc("Linears held packed (dflash-quant PackedLinear or the backend's modules)")
    kernel: str | None = doc(
        "`dequant-chunked` (CPU: a block of rows dequantized per forward), `tinygemm-int4` (CUDA) or the backend's"
    )
    resident_bytes: int | None = doc("the target's weights as held in memory (parameters and buffers, tied once)")
    extra: E = doc("", factory=dict)


def target_quant_label(tq: dict[str, Any]) -> str:
    """One line for tables and cards: `compressed-tensors pack-quantized W4 g32 sym, 6.23 MiB resident`."""
    size = f"{tq['resident_bytes'] / 2**20:.2f} MiB resident" if tq.get("resident_bytes") is not None else ""
    if not tq.get("format"):
        return f"dense, {size}" if size else "dense"
    group = "per-channel" if tq.get("group_size") == -1 else f"g{tq.get('group_size')}"
    grid = "sym" if tq.get("symmetric") else "asym"
    head = f"{tq.get('quant_method')} {tq.get('format')} W{tq.get('bits')} {group} {grid}, kernel {tq.get('kernel')}"
    return f"{head}, {size}" if size else head


@dataclass
class DrafterKernel(Record):
    kernel: str | None = doc(
        "how the quantized drafter's Linears ran: `cuda`, `triton`, `gemlite`, `tinygemm` (int4 kernels, CUDA) or `dequant` "
        "(weights dequantized to the compute dtype)"
    )
    linears: int | None = doc("Linears run through the int4 kernel (0 for dequant)")
    fused_groups: int | None = doc("groups of Linears run as one GEMM each (q|k|v or k|v, gate|up)", omit_none=True)
    reason: str | None = doc("why the dequantized path ran (CPU, not 4 bits, not GPTQ, `--int4-kernel dequant`)")
    extra: E = doc("", factory=dict)


@dataclass
class Provenance(ReportFile):
    FILE: ClassVar[str] = "provenance.json"
    WRITER: ClassVar[str] = "export"
    FIX: ClassVar[str] = f"{REEXPORT} (provenance.json is written by the export stage)"

    tool: str | None = doc("`dflash-quant`")
    tool_version: str | None = doc("version that wrote it")
    created_utc: str | None = doc("ISO 8601 time")
    command: list[str] | None = doc("argv, local paths in their portable form")
    source_drafter: SourceRef | None = doc("the bf16 drafter quantized")
    target: SourceRef | None = doc("the target it was calibrated and checked with")
    target_quantization: TargetQuantization | None = doc(
        "the target's quantization and resident bytes as loaded (dense targets: format null)", omit_none=True
    )
    calibration: Calibration | None = doc("calibration data")
    quantization: Quantization | None = doc("recipe")
    mixed: Mixed | None = doc(
        "per-Linear mixed precision chosen by a search (gptq --max-tau-loss/--max-bytes/--max-bits-per-weight/--fit)",
        omit_none=True,
    )
    device: str | None = doc("device of the run")
    dtype: str | None = doc("compute dtype of the run")
    extra: E = doc("", factory=dict)


# ------------------------------------------------------------------------------------------ quant report


@dataclass
class LayerReport(Record):
    name: str = doc("Linear name", required=True)
    shape: list[int] | None = doc("[out, in]")
    bits: int | None = doc("bits")
    group_size: int | None = doc("group size")
    hessian_rows: int | None = doc("calibration rows in its Hessian (null for RTN)")
    damp: float | None = doc("dampening used (raised automatically when needed)")
    fallback: str | None = doc("null, or `rtn: <why>` when GPTQ fell back")
    rel_output_error: float | None = doc("||X dW^T|| / ||X W^T|| over the calibration rows")
    method: str | None = doc(
        "how its codes and scales were chosen: `gptq`, `gptq-kl` (scales and codes tuned on the drafter's KL and the target's tokens), `rtn`",
        omit_none=True,
    )
    extra: E = doc("", factory=dict)


@dataclass
class QuantReport(ReportFile):
    FILE: ClassVar[str] = "quant_report.json"
    WRITER: ClassVar[str] = "export"
    FIX: ClassVar[str] = REEXPORT

    layers: list[LayerReport] = doc("one entry per quantized Linear", factory=list)
    kept_bf16: list[str] | None = doc("Linears kept in bf16")
    original_bytes: int | None = doc("bf16 bytes of the quantized Linears")
    quantized_bytes: int | None = doc("their packed bytes in model.safetensors")
    seconds: float | None = doc("quantization time")
    drafter_bytes_bf16: int | None = doc("every tensor of the source drafter at bf16", omit_none=True)
    drafter_bytes_quantized: int | None = doc("every tensor in the written weights file", omit_none=True)
    by_part: dict[str, Any] | None = doc(
        "`{bf16, quantized}`: bytes by part (backbone Linears, fc, norms, conv, selector codebooks, selector projection)",
        omit_none=True,
    )
    tuning: dict[str, Any] | None = doc(
        "gptq-kl: epochs, lr, steps, seconds, KL to the bf16 drafter on the calibration inputs before/after, "
        "and each Linear's mean |log scale change|",
        omit_none=True,
    )
    extra: E = doc("", factory=dict)


# ------------------------------------------------------------------------------------------ parity


@dataclass
class CategoryTau(Record):
    """tau of one prompt category (the built-in set's code / math / chat / reproduce)."""

    prompts: int | None = doc("prompts in the category")
    tau: float | None = doc("mean accepted tokens + 1 per step")
    tau_without: float | None = doc("lookup record only: the same drafter without lookup", omit_none=True)
    tau_ratio: float | None = doc("lookup record only: tau / tau_without", omit_none=True)
    lookup_step_share: float | None = doc(
        "lookup record only: steps that verified a lookup token / steps", omit_none=True
    )
    verified_tokens_ratio: float | None = doc(
        "lookup record only: target tokens verified with lookup / without (compute of the verify forwards)",
        omit_none=True,
    )
    extra: E = doc("", factory=dict)


@dataclass
class LookupCheck(Record):
    """The same drafter with the lookup proposer (`--lookup`; the rule per step is in dflash_quant/speculative/lookup.py)."""

    mode: str | None = doc("`prefer` | `agree` | `extend` | `both`: which proposal a step verifies")
    min_ngram: int | None = doc("shortest suffix a match needs")
    max_ngram: int | None = doc("longest suffix searched")
    max_tokens: int | None = doc("lookup tokens proposed per step at most (`both`: the lookup row's length)")
    tau: float | None = doc("tau with lookup")
    tau_without: float | None = doc("tau of the same drafter, prompts and target without lookup (the Check's tau)")
    tau_ratio: float | None = doc("tau / tau_without")
    lossless: bool | None = doc("greedy output with lookup == the target's own (null when not greedy)")
    lossless_status: str | None = doc("as Check.lossless_status, for the run with lookup")
    token_match_rate: float | None = doc("as Check.token_match_rate, for the run with lookup")
    divergences: list[dict[str, Any]] | None = doc("as Check.divergences, for the run with lookup")
    steps: int | None = doc("speculative steps")
    lookup_steps: int | None = doc("steps that verified at least one lookup token")
    lookup_step_share: float | None = doc("lookup_steps / steps")
    per_position_acceptance_drafter: list[float | None] | None = doc(
        "index k-1: fraction of the steps verifying a drafter token at position k that accepted it"
    )
    per_position_acceptance_lookup: list[float | None] | None = doc(
        "index j: fraction of the steps proposing a (j+1)-th lookup token that accepted it (in `extend` after "
        "the drafter's block, so only reached when the whole block was accepted; in `both` each row counts its own "
        "accepted tokens, whichever row the step committed)"
    )
    target_forwards: int | None = doc("target prefill and verify forward passes")
    verified_tokens: int | None = doc("tokens the verify forwards processed (rows x length; `both` verifies 2 rows)")
    verified_tokens_without: int | None = doc("the same without lookup")
    verified_tokens_ratio: float | None = doc("verified_tokens / verified_tokens_without (verify compute)")
    two_row_steps: int | None = doc("`both`: steps that verified the drafter's block and the lookup as 2 rows")
    lookup_row_steps: int | None = doc("`both`: two-row steps that committed the lookup row")
    drafter_forwards: int | None = doc("drafter forward passes (`prefer` skips the drafter on lookup steps)")
    target_replay_forwards: int | None = doc("hybrid targets: replay forwards (Check.target_replay_forwards)")
    spec_seconds: float | None = doc("wall time of speculative decoding with lookup")
    lookup_seconds: float | None = doc("time of the history searches (inside spec_seconds)")
    spec_tokens_per_s: float | None = doc("new tokens / spec_seconds")
    speedup: float | None = doc("spec_tokens_per_s / target-only tokens per second")
    by_category: dict[str, CategoryTau] | None = doc("per prompt category: tau with and without lookup")
    extra: E = doc("", factory=dict)


@dataclass
class Check(Record):
    """One drafter's run of the speculative decode check (also `verify --json`'s `summary`)."""

    drafter: str | None = doc("the drafter's id (portable form)")
    tau: float | None = doc("mean accepted tokens + 1 per step over all steps")
    tau_mean_of_requests: float | None = doc("mean of the per-prompt tau")
    per_position_acceptance: list[float | None] | None = doc(
        "index k-1: fraction of steps where draft position k was accepted (B-1 entries)"
    )
    acceptance_histogram: list[int] | None = doc("index a: steps that accepted exactly a drafts (B entries)")
    lossless: bool | None = doc("greedy output == the target's own (null when not greedy)")
    lossless_status: str | None = doc(
        "`exact` | `near-ties` (every divergence at a near-tie of the target) | `diverged`"
    )
    token_match_rate: float | None = doc("common prefix with the target-only output / target-only tokens")
    logits_dtype: str | None = doc("dtype of the target's logits (judges near-ties)")
    divergences: list[dict[str, Any]] | None = doc(
        "`{prompt_index, position, target_margin, near_tie_margin, near_tie}` per differing prompt: the first "
        "differing position and the target-only run's top-1/top-2 logit margin there"
    )
    steps: int | None = doc("speculative steps")
    target_forwards: int | None = doc("target prefill and verify forward passes")
    drafter_forwards: int | None = doc("drafter forward passes")
    target_replay_forwards: int | None = doc(
        "hybrid targets: extra forwards replaying committed tokens after a rollback"
    )
    replayed_tokens: int | None = doc("hybrid targets: tokens replayed in those forwards")
    replay_seconds: float | None = doc("hybrid targets: time of those forwards (inside spec_seconds)")
    new_tokens: int | None = doc("tokens generated")
    spec_seconds: float | None = doc("wall time of speculative decoding (of the prompts decoded one by one)")
    spec_tokens_per_s: float | None = doc("their new tokens / spec_seconds")
    spec_timed_prompts: int | None = doc(
        "with `--check-batch` > 1: prompts decoded one by one, whose time gives spec_seconds (the others ran as "
        "rows of a batch: same tokens and steps, timed only as batches)",
        omit_none=True,
    )
    spec_batch: int | None = doc("with `--check-batch` > 1: the most prompts decoded as one batch", omit_none=True)
    spec_batched_prompts: int | None = doc("with `--check-batch` > 1: prompts decoded in batches", omit_none=True)
    spec_batched_seconds: float | None = doc(
        "with `--check-batch` > 1: wall time of those batches (not in spec_seconds)", omit_none=True
    )
    baseline_seconds: float | None = doc("wall time of target-only decoding (of the timed prompts)")
    baseline_tokens_per_s: float | None = doc("target-only tokens per second (of the timed prompts)")
    baseline_timed_prompts: int | None = doc(
        "prompts decoded target-only one token per forward for that speed (`gptq` checks the others' greedy "
        "tokens in one forward each; `--full-baseline` decodes every prompt)",
        omit_none=True,
    )
    speedup: float | None = doc("spec_tokens_per_s / baseline_tokens_per_s")
    per_prompt: list[dict[str, Any]] | None = doc("`{prompt_index, tau, steps, new_tokens, lossless}` per prompt")
    by_category: dict[str, CategoryTau] | None = doc("per prompt category (prompt sets that have them)", omit_none=True)
    lookup: LookupCheck | None = doc("the same drafter with the lookup proposer (`--lookup`)", omit_none=True)
    extra: E = doc("", factory=dict)


@dataclass
class Parity(ReportFile):
    FILE: ClassVar[str] = "parity.json"
    WRITER: ClassVar[str] = "verify stage of `gptq`"
    FIX: ClassVar[str] = "re-run the parity check with `dflash-quant gptq`"

    passed: bool | None = doc("the gate's verdict")
    tolerance: float | None = doc("fails when tau_ratio < 1 - tolerance")
    tau_ratio: float | None = doc("quantized tau / bf16 tau")
    per_position_ratio: list[float | None] | None = doc("per-position acceptance ratio")
    lossless: bool | None = doc("the quantized drafter's greedy output is the target's")
    reasons: list[str] | None = doc("why it failed")
    notes: list[str] | None = doc("reported, not gated")
    lossless_gated: bool | None = doc("fp32: any divergence fails; reduced precision: a `diverged` status fails")
    lossless_status: str | None = doc("the quantized drafter's Check.lossless_status")
    cache: dict[str, str] | None = doc(
        "`{target_only, bf16_drafter}`: `hit` (runs and timings reused from an earlier run's check cache), `miss` or `off`",
        omit_none=True,
    )
    temperature: float | None = doc("0 (greedy)")
    prompt_set: str | None = doc("held-out prompt set")
    num_prompts: int | None = doc("prompts")
    max_new_tokens: int | None = doc("tokens per prompt")
    block_size: int | None = doc("draft block size")
    device: str | None = doc("device")
    dtype: str | None = doc("compute dtype")
    baseline: Check | None = doc("the bf16 drafter's run")
    quantized: Check | None = doc("the quantized drafter's run")
    target_quantization: TargetQuantization | None = doc(
        "the target checked against: its quantization and resident bytes", omit_none=True
    )
    drafter_kernel: DrafterKernel | None = doc(
        "how the quantized drafter ran (int4 kernel or dequantized)", omit_none=True
    )
    spec_speed_ratio: float | None = doc(
        "quantized spec_tokens_per_s / bf16 spec_tokens_per_s, same run (bf16 from the cache if `cache` says hit)",
        omit_none=True,
    )
    teacher_forced: bool | None = doc(
        "both drafters ran against the target's greedy continuation decoded once (--teacher-forced): tau and "
        "acceptance only, `lossless` not checked (null)",
        omit_none=True,
    )
    extra: E = doc("", factory=dict)


# ------------------------------------------------------------------------------------------ budget


@dataclass
class GpuRef(Record):
    name: str | None = doc("card name")
    total_bytes: int | None = doc("its memory")
    extra: E = doc("", factory=dict)


@dataclass
class BudgetSettingsRecord(Record):
    context: int | None = doc("tokens per request")
    concurrency: int | None = doc("requests at once")
    spec_tokens: int | None = doc("K drafted tokens per step")
    gpu_memory_utilization: float | None = doc("engine memory fraction")
    runtime_overhead_bytes: int | None = doc("non-torch memory")
    cuda_graph_bytes: int | None = doc("CUDA-graph reserve")
    prefill_chunk: int | None = doc("tokens per prefill forward")
    max_num_seqs: int | None = doc("vLLM max_num_seqs")
    activation_override_bytes: int | None = doc("activation override, if given")
    new_tokens: int | None = doc("reference engine: generated tokens")
    prefix_caching: bool | None = doc("vllm, hybrid targets: prefix caching on (2 + K state pages, else 1 + K)")
    extra: E = doc("", factory=dict)


@dataclass
class TargetSummary(Record):
    source: str | None = doc("preset, shipped name, Hub id or portable path")
    weight_bytes: int | None = doc("resident weight bytes")
    weight_format: str | None = doc("bf16, int4, ...")
    weights_from: str | None = doc("how the bytes were found")
    extra: E = doc("", factory=dict)


@dataclass
class DrafterSummary(Record):
    source: str | None = doc("preset, shipped name, Hub id or portable path")
    bf16_bytes: int | None = doc("bf16 weight bytes")
    quantized_bytes: int | None = doc("quantized weight bytes")
    quantized_format: str | None = doc("int4, ...")
    weights_from: str | None = doc("how the bytes were found")
    bf16_by_part: dict[str, int] | None = doc("bf16 drafter bytes by part", omit_none=True)
    quantized_by_part: dict[str, int] | None = doc("quantized drafter bytes by part", omit_none=True)
    extra: E = doc("", factory=dict)


@dataclass
class Caches(Record):
    target_kv_bytes_per_token: int | None = doc("target KV per token")
    target_full_attention_bytes_per_token: int | None = doc("of which full-attention layers")
    target_sliding_bytes_per_token: int | None = doc("of which sliding-window layers")
    target_sliding_window: int | None = doc("their window")
    target_state_bytes_per_request: int | None = doc("recurrent state per request")
    target_state_slots: int | None = doc("state slots kept while speculating")
    target_state_dtype: str | None = doc("state dtype")
    drafter_kv_bytes_per_token: int | None = doc("drafter context KV per token")
    drafter_sliding_window: int | None = doc("drafter window")
    kv_dtype: str | None = doc("KV dtype")
    kv_bytes_per_element: int | None = doc("bytes per KV element")
    extra: E = doc("", factory=dict)


@dataclass
class BudgetForm(Record):
    """The budget for one form of the drafter (bf16, or the quantized one)."""

    engine: str | None = doc("vllm or reference")
    gpu: str | None = doc("card name")
    gpu_bytes: int | None = doc("card memory")
    utilization: float | None = doc("memory fraction used")
    usable_bytes: int | None = doc("gpu_bytes x utilization")
    context: int | None = doc("tokens per request")
    concurrency: int | None = doc("requests")
    spec_tokens: int | None = doc("K")
    drafter_form: str | None = doc("`bf16` or the quantized format")
    components: dict[str, int] | None = doc("bytes by component")
    allocator_peak_bytes: int | None = doc("weights + caches + activation")
    required_bytes: int | None = doc("allocator peak + overhead + CUDA graphs")
    headroom_bytes: int | None = doc("usable - required (negative: does not fit)")
    drafter_room_bytes: int | None = doc(
        "usable - everything but the drafter's weights: the most its weights may take (what `gptq --fit` sizes to)"
    )
    fits: bool | None = doc("headroom >= 0")
    max_context: int | None = doc("largest context that fits (null: none)")
    max_context_limited_by: str | None = doc("memory or max_position_embeddings")
    max_concurrency: int | None = doc("most requests that fit at `context`")
    notes: list[str] | None = doc("caveats")
    extra: E = doc("", factory=dict)


@dataclass
class Budget(Record):
    """`dflash-quant budget --json`, and `budget_24gb` in memory.json."""

    gpu: GpuRef | None = doc("card")
    engine: str | None = doc("engine modelled")
    settings: BudgetSettingsRecord | None = doc("settings")
    target: TargetSummary | None = doc("target")
    drafter: DrafterSummary | None = doc("drafter")
    caches: Caches | None = doc("per-token and per-request cache bytes")
    budgets: dict[str, BudgetForm] = doc("`bf16` and the quantized form (e.g. `int4`)", factory=dict)
    compare_mtp: dict[str, Any] | None = doc(
        "targets with an MTP head: no speculation, MTP (K = 1..3) and DFlash side by side (`budget --compare-mtp`)",
        omit_none=True,
    )
    extra: E = doc("", factory=dict)

    def quantized_form(self) -> str | None:
        return next((k for k in self.budgets if k != "bf16"), None)


@dataclass
class CalibrationFix(Record):
    """What would make a calibration fit: where the Hessians go and how much of the target stays on the GPU."""

    fits: bool | None = doc("the calibration fits with these flags")
    flags: list[str] | None = doc("the gptq flags to add")
    gpu_bytes: int | None = doc("predicted peak on the GPU with them")
    cpu_bytes: int | None = doc("host memory they need for offloaded target weights and Hessians")
    target_on_gpu_bytes: int | None = doc("target weight bytes --max-memory leaves on the GPU")
    streamed_bytes: int | None = doc(
        "target weight bytes left in host memory, which accelerate copies onto the GPU for every target forward "
        "(0: the target stays whole on the GPU)",
        omit_none=True,
    )
    extra: E = doc("", factory=dict)


@dataclass
class CalibrationBudget(Record):
    """`dflash-quant budget --calibration --json`: will `gptq`'s calibration fit on this GPU with this target?"""

    gpu: GpuRef | None = doc("card")
    usable_bytes: int | None = doc("card bytes less `reserve_bytes`")
    reserve_bytes: int | None = doc("kept free for the CUDA context and allocator slack")
    target: str | None = doc("target (preset, directory or config)")
    drafter: str | None = doc("drafter (preset, directory or config)")
    prompt_tokens: int | None = doc("longest calibration prompt, tokens")
    max_new_tokens: int | None = doc("tokens generated per calibration prompt")
    kv_hessian: str | None = doc("`block` or `block+context`")
    predicted: dict[str, int] | None = doc("bytes per term on one GPU (memory.calibration.predict_calibration)")
    phase: str | None = doc("`prefill` or `last_step`: which forward sets the peak")
    peak_bytes: int | None = doc("predicted peak with everything on the GPU")
    fits: bool | None = doc("peak_bytes <= usable_bytes")
    fix: CalibrationFix | None = doc("when it does not fit: the cheapest flags that make it fit", omit_none=True)
    extra: E = doc("", factory=dict)


# ------------------------------------------------------------------------------------------ memory


@dataclass
class Weights(Record):
    total_bytes: int | None = doc("bytes of all tensors")
    by_module: dict[str, int] | None = doc("bytes by module")
    by_dtype: dict[str, int] | None = doc("bytes by dtype")
    num_tensors: int | None = doc("tensors")
    params: int | None = doc("parameters (quantized ones counted unpacked)")
    quantized_linears: int | None = doc("GPTQ Linears")
    packed_quantized_bytes: int | None = doc("their packed bytes")
    dequantized_bf16_bytes: int | None = doc("bytes once dequantized to bf16")
    by_part: dict[str, int] | None = doc("bytes by drafter part (conv, selector, ...)", omit_none=True)
    extra: E = doc("", factory=dict)


@dataclass
class Baseline(Record):
    path: str | None = doc("the bf16 drafter (shipped name, Hub id or portable path)")
    total_bytes: int | None = doc("its weight bytes")
    disk_bytes: int | None = doc("its bytes on disk")
    ratio: float | None = doc("quantized / bf16 weight bytes")
    saved_bytes: int | None = doc("bytes saved")
    by_part: dict[str, int] | None = doc("baseline bytes by drafter part", omit_none=True)
    extra: E = doc("", factory=dict)


@dataclass
class Resident(Record):
    device: str | None = doc("cpu or cuda")
    bytes: int | None = doc("measured bytes")
    held_bytes: int | None = doc("bytes still held after loading")
    method: str | None = doc("`allocator peak` or `tensor bytes`")
    form: str | None = doc("what the loader holds (`dequantized bf16`)")
    packed_bytes: int | None = doc("what an int4 kernel would hold")
    extra: E = doc("", factory=dict)


@dataclass
class ContextKV(Record):
    dtype: str | None = doc("KV dtype")
    full_attention_bytes_per_token: int | None = doc("full-attention layers")
    sliding_bytes_per_token: int | None = doc("sliding-window layers")
    sliding_window: int | None = doc("window")
    layers: int | None = doc("layers")
    extra: E = doc("", factory=dict)


@dataclass
class MemoryReport(ReportFile):
    FILE: ClassVar[str] = "memory.json"
    WRITER: ClassVar[str] = "`dflash-quant memory` (also run by `gptq`)"
    FIX: ClassVar[str] = "re-run `dflash-quant memory` on the artifact"

    artifact: str | None = doc("the artifact's name (portable form)")
    weights: Weights | None = doc("weights as stored")
    disk_bytes: int | None = doc("bytes of all files")
    baseline: Baseline | None = doc("null, or the bf16 drafter compared with")
    resident: Resident | None = doc("null, or memory measured after loading")
    context_kv_bytes_per_token: int | None = doc("drafter context KV per token (bf16)")
    context_kv: ContextKV | None = doc("its parts")
    budget_24gb: Budget | None = doc("null, or the 24 GB budget (same shape as `budget --json`)")
    extra: E = doc("", factory=dict)


# ------------------------------------------------------------------------------------------ manifest


@dataclass
class FileEntry(Record):
    sha256: str = doc("hex digest", required=True)
    bytes: int = doc("size", required=True)
    extra: E = doc("", factory=dict)


@dataclass
class Manifest(ReportFile):
    FILE: ClassVar[str] = "manifest.json"
    WRITER: ClassVar[str] = "export; `card` and `memory` update only their own entries"
    FIX: ClassVar[str] = REEXPORT

    format: int = doc("1", default=1)
    files: dict[str, FileEntry] = doc("relative POSIX path -> entry", factory=dict)
    extra: E = doc("", factory=dict)


REPORT_FILES = (Provenance, QuantReport, Parity, MemoryReport, Manifest)
