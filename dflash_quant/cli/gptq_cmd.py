"""`dflash-quant gptq`: the main job, a thin layer over dflash_quant.pipeline.run_gptq."""

from __future__ import annotations

import sys
from pathlib import Path

import typer
from rich.table import Table

from dflash_quant.cli.common import (
    as_stop,
    device_map_option,
    device_option,
    err_console,
    fail,
    handle_errors,
    int4_kernel_option,
    max_memory_option,
    note,
    out_console,
    print_json,
    progress_bar,
    stage_progress,
    stop_message,
)
from dflash_quant.io.cache_dirs import calib_store_dir, check_cache_dir
from dflash_quant.memory.gpus import parse_bytes
from dflash_quant.quantize.settings import (
    TUNE_CODE_TRAVEL,
    TUNE_EPOCHS,
    TUNE_LR,
    TUNE_LR_KQUANT,
    TUNE_MIN_PROMPTS,
    TUNE_ROWS_DEFAULT,
    TUNE_TARGET,
)


def _fmt_bytes(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:.2f} MiB"


def _summary(result) -> Table:
    rep, par, t = result.quant_report, result.parity, result.timings
    table = Table(title=f"dflash-quant gptq -> {result.output}")
    table.add_column("")
    table.add_column("value", justify="right")
    table.add_row("quantized Linears", str(len(rep["layers"])))
    table.add_row("kept in bf16", str(len(rep["kept_bf16"])))
    table.add_row("their bf16 bytes", _fmt_bytes(rep["original_bytes"]))
    table.add_row("their quantized bytes", _fmt_bytes(rep["quantized_bytes"]))
    if rep["original_bytes"]:
        table.add_row("quantized / bf16", f"{rep['quantized_bytes'] / rep['original_bytes']:.3f}")
    if rep.get("drafter_bytes_bf16") and rep.get("drafter_bytes_quantized"):
        table.add_row("whole drafter bf16", _fmt_bytes(rep["drafter_bytes_bf16"]))
        table.add_row("whole drafter quantized", _fmt_bytes(rep["drafter_bytes_quantized"]))
        table.add_row(
            "whole drafter quantized / bf16", f"{rep['drafter_bytes_quantized'] / rep['drafter_bytes_bf16']:.3f}"
        )
        bf16_parts = rep["by_part"]["bf16"]
        for part in ("conv", "selector_codebooks", "selector_projection"):
            if bf16_parts.get(part) and rep["by_part"].get("quantized"):
                table.add_row(f"  of which {part.replace('_', ' ')}", _fmt_bytes(rep["by_part"]["quantized"][part]))
    if tq := result.target_quantization:
        table.add_row("target weights resident", _fmt_bytes(tq.get("resident_bytes")))
        if tq.get("format"):
            from dflash_quant.artifact.reports import target_quant_label

            table.add_row("target quantization", target_quant_label(tq))
    if par:
        table.add_row("tau bf16 (T=0)", f"{par['baseline']['tau']:.3f}")
        table.add_row("tau quantized (T=0)", f"{par['quantized']['tau']:.3f}")
        table.add_row("tau ratio", f"{par['tau_ratio']:.4f}")
        for which in ("baseline", "quantized"):
            if lk := par[which].get("lookup"):
                label = "bf16" if which == "baseline" else "quantized"
                table.add_row(
                    f"tau {label} + lookup",
                    f"{lk['tau']:.3f} (x{lk['tau_ratio']}, lookup in {lk['lookup_step_share']:.0%} of steps)",
                )
        table.add_row("lossless", str(par["lossless"]))
        table.add_row("parity", "PASS" if par["passed"] else "FAIL")
    else:
        table.add_row("parity", "not run (--no-verify)")
    mem = (result.calibration or {}).get("memory")
    if mem and mem.get("measured_bytes"):
        kind = "GPU allocator" if mem["measured_kind"] == "cuda_max_memory_allocated" else "CPU tracked tensors"
        table.add_row("calibration peak", f"{_fmt_bytes(mem['measured_bytes'])} ({kind}), x{mem['ratio']} of predicted")
    if (result.calibration or {}).get("cached"):  # else "calibration time 0.0 s" alone reads as a skipped stage
        where = "the calibration store" if result.calibration.get("store") == "hit" else "--calib-cache"
        table.add_row("calibration", f"reused from {where}")
    if resumed := (result.calibration or {}).get("resumed_prompts"):
        table.add_row("calibration resumed", f"{resumed} prompts from the checkpoint")
    for key, label in (
        ("calibrate_s", "calibration"),
        ("quantize_s", "quantization"),
        ("verify_s", "parity check"),
        ("total_s", "total"),
    ):
        if key in t:
            table.add_row(f"{label} time", f"{t[key]:.1f} s")
    return table


def _stopped(exc: BaseException, kept) -> None:
    """The one line for a signal: what was cleaned up and, after a checkpoint, that a rerun resumes."""
    message, code = stop_message(exc)
    done = kept.done() if kept is not None else None  # calibration.checkpoint.Kept
    if kept is not None and done is not None:
        message += (
            f"; the partial calibration ({done} of {kept.total} prompts) was kept in the cache at "
            f"{kept.path.parent}: rerun the same command to resume it"
        )
    fail(message, code)


@handle_errors
def gptq(
    drafter: str = typer.Argument(
        "reference", help="bf16 drafter dir or Hub id (default: the shipped reference pair)."
    ),
    target: str | None = typer.Option(
        None, "--target", "-t", help="Target dir or Hub id (default: the reference target for 'reference')."
    ),
    bits: int = typer.Option(4, help="2, 3, 4 or 8."),
    group_size: int = typer.Option(128, help="-1 (per channel), 32, 64, 128, ..."),
    sym: bool = typer.Option(True, "--sym/--asym", help="Symmetric (vLLM Marlin) or asymmetric grid."),
    desc_act: bool = typer.Option(
        False, "--desc-act/--no-desc-act", help="Act-order: quantize columns by decreasing Hessian diagonal."
    ),
    static_groups: bool = typer.Option(False, help="With --desc-act: group parameters fixed before reordering."),
    clip_search: bool = typer.Option(
        False,
        "--clip-search/--no-clip-search",
        help="Shrink each group's range by the factor that minimises its Hessian-weighted rounding error before "
        "GPTQ (static groups; plain GPTQ v1 scales). The mixed search (--max-bytes ...) tries it per Linear.",
    ),
    damp: float = typer.Option(
        0.01, help="Dampening as a fraction of the mean Hessian diagonal (raised automatically if needed)."
    ),
    method: str = typer.Option(
        "gptq",
        help="gptq; gptq-kl (GPTQ codes, then each group's scale and code tuned on the calibration inputs against "
        "the drafter's KL to its bf16 self and the target's own tokens, on the block rows acceptance reads: better "
        "below 4 bits; with --gguf-type each super-block's d/dmin); or rtn "
        "(round-to-nearest baseline).",
    ),
    tune_epochs: int = typer.Option(TUNE_EPOCHS, help="gptq-kl: passes over the recorded calibration inputs."),
    tune_lr: float | None = typer.Option(
        None,
        help=f"gptq-kl: Adam step size on each group's log scale [default: {TUNE_LR}; {TUNE_LR_KQUANT} with --gguf-type].",
    ),
    tune_codes: bool = typer.Option(
        True, "--tune-codes/--no-tune-codes", help="gptq-kl: let each code move one step (signed-gradient offsets)."
    ),
    tune_code_travel: float = typer.Option(
        TUNE_CODE_TRAVEL, help="gptq-kl: how far (code steps) a code offset may move over the whole tuning."
    ),
    tune_anchor: float = typer.Option(
        0.0,
        help="gptq-kl: add this times each Linear's Hessian-weighted error to its bf16 weights (relative, mean over "
        "Linears) to the KL: the calibration statistics of every prompt hold the tuning near GPTQ's objective.",
    ),
    tune_norms: bool = typer.Option(
        False,
        "--tune-norms/--no-tune-norms",
        help="gptq-kl: tune the drafter's RMSNorm weights too (one multiplier per channel; they stay unquantized).",
    ),
    tune_position_decay: float = typer.Option(
        0.0,
        help="gptq-kl: weigh block position k's KL by exp(-(k-1)/D), since a later position counts only when the "
        "earlier ones were accepted (0: every position weighs 1).",
    ),
    tune_rows: str = typer.Option(
        TUNE_ROWS_DEFAULT,
        help="gptq-kl: all | reached (score only the block rows the bf16 drafter's own drafts reach: every earlier "
        "row drafted the target's token).",
    ),
    tune_target: float = typer.Option(
        TUNE_TARGET,
        help="gptq-kl: add this weight x the cross-entropy to the target's own token on the scored rows (0: KL alone).",
    ),
    sequential: bool = typer.Option(
        False,
        "--sequential/--no-sequential",
        help="Quantize stage by stage, feeding later stages the quantized outputs.",
    ),
    profile: str = typer.Option("full", help="full | vllm (keeps q/k/v bf16) | sglang (keeps q/k/v and fc bf16)."),
    quantize_conv: bool = typer.Option(
        False,
        "--quantize-conv",
        help="DFlash2: also quantize the convolutions' kernel_projection Linears (engines keep them bf16; base_kernel always stays bf16).",
    ),
    quantize_selector: bool = typer.Option(
        False,
        "--quantize-selector",
        help="DFlash2: also quantize the selector's hidden_projection (engines keep it bf16; the codebooks always stay bf16).",
    ),
    skip: list[str] = typer.Option([], "--skip", help="Regex of Linear names to keep in bf16 (repeatable)."),
    output: Path = typer.Option(Path("out/drafter-gptq"), "--output", "-o", help="Artifact directory to create."),
    overwrite: bool = typer.Option(
        False,
        help="Replace a previous dflash-quant artifact (one with manifest.json) at --output; never a directory that overlaps an input.",
    ),
    calib_prompts: str | None = typer.Option(
        None, help="Calibration prompts: builtin:calib (default), reference:calib, or a file."
    ),
    num_prompts: int | None = typer.Option(None, help="Use only the first N calibration prompts."),
    max_new_tokens: int = typer.Option(64, min=1, help="Tokens generated per calibration prompt."),
    kv_hessian: str = typer.Option(
        "block+context", help="Rows in the k/v Hessian: block, or block+context (default: measured better)."
    ),
    calib_cache: Path | None = typer.Option(
        None,
        help="Directory to save/reuse calibration statistics (replaces the store below for this run).",
    ),
    no_calib_cache: bool = typer.Option(
        False,
        "--no-calib-cache",
        help="Neither reuse nor store finished calibrations (~/.cache/dflash-quant/calib): always recalibrate "
        "(an interrupted run's checkpoint still waits there for its rerun).",
    ),
    calib_cache_max_gb: float = typer.Option(
        20.0,
        "--calib-cache-max-gb",
        min=0.0,
        envvar="DFLASH_QUANT_CALIB_CACHE_MAX_GB",
        help="Size cap of the calibration store; the least recently used entries are evicted first.",
    ),
    verify: bool = typer.Option(True, "--verify/--no-verify", help="Run the bf16-vs-quantized parity gate."),
    eval_prompts: str | None = typer.Option(
        None, help="Held-out parity prompts (default: builtin:heldout / reference:heldout)."
    ),
    eval_num_prompts: int | None = typer.Option(None, help="Use only the first N parity prompts."),
    eval_max_new_tokens: int = typer.Option(128, min=1, help="Tokens generated per parity prompt."),
    tolerance: float = typer.Option(0.03, help="Fail when tau_q / tau_bf16 < 1 - tolerance; in [0, 1)."),
    device: str = device_option(),
    device_map: str | None = device_map_option(),
    max_memory: str | None = max_memory_option(),
    hessian_device: str | None = typer.Option(
        None, "--hessian-device", help="cpu | cuda[:N]: where the fp32 Hessians accumulate (default: --device)."
    ),
    gpu_memory_limit: str | None = typer.Option(
        None,
        "--gpu-memory-limit",
        help="The most GPU memory this run may hold, e.g. 20GiB (a card shared with a server, or a smaller card "
        "emulated): the allocator is capped there and the GPTQ solve budgets within it.",
    ),
    calib_checkpoint_every: int = typer.Option(
        16,
        "--calib-checkpoint-every",
        min=0,
        help="Checkpoint calibration every N prompts into the calibration cache, so the rerun of an interrupted "
        "command resumes (0: off).",
    ),
    calib_batch: int | None = typer.Option(
        None,
        "--calib-batch",
        help="Calibration: decode up to N prompts as rows of one batch (same Hessian rows; padding excluded). "
        "Default 16 on CPU; on CUDA 64, fewer if their predicted memory exceeds half the free memory. Hybrid "
        "targets and --sequential decode one by one.",
    ),
    teacher_forced: bool = typer.Option(
        False,
        "--teacher-forced/--no-teacher-forced",
        help="Calibration and parity check: decode the target's greedy continuation once, --calib-batch prompts "
        "per batch, and replay the speculative loop from it (the same drafter inputs and acceptance at T=0, no "
        "target forward per step). For hybrid or offloaded targets, where the loop decodes one by one; the check "
        "then reports tau and per-position acceptance, not losslessness or speed.",
    ),
    dtype: str = typer.Option("auto", help="auto (cpu: float32, cuda: bfloat16)."),
    int4_kernel: str = int4_kernel_option(),
    chat_template: bool = typer.Option(True, "--chat-template/--no-chat-template"),
    check_cache: Path | None = typer.Option(
        None,
        help="Where the parity check's target-only and bf16 drafter runs are cached (default ~/.cache/dflash-quant/check).",
    ),
    no_check_cache: bool = typer.Option(
        False, "--no-check-cache", help="Neither read nor write that cache (every run recomputed)."
    ),
    full_baseline: bool = typer.Option(
        False,
        "--full-baseline",
        help="Decode every parity prompt target-only (default: check the bf16 run's tokens in one target "
        "forward per prompt and decode the first 4 for the speed baseline).",
    ),
    check_batch: int | None = typer.Option(
        None,
        "--check-batch",
        help="Parity check: decode the speculative runs of up to N prompts as rows of one batch (same tokens and "
        "acceptance as one by one in fp32; the first 4 prompts still run alone for the speed numbers). Default 16 "
        "on CPU; on CUDA 64 in fp32 (capped by memory as --calib-batch), 1 in bf16/fp16, where batched numerics "
        "widen the tau ratio's spread. Hybrid targets and --lookup's runs decode one by one.",
    ),
    card: bool = typer.Option(True, "--card/--no-card", help="Write the model card (README.md) into the artifact."),
    json_out: bool = typer.Option(False, "--json", help="Print the result as JSON on stdout."),
    lookup: bool = typer.Option(
        False,
        "--lookup/--no-lookup",
        help="Parity check: also run both drafters with the lookup proposer and report tau with and without it.",
    ),
    lookup_mode: str = typer.Option(
        "both", help="With --lookup: both | prefer | agree | extend (see dflash_quant/speculative/lookup.py)."
    ),
    lookup_min_ngram: int = typer.Option(2, help="With --lookup: shortest history suffix a match needs."),
    lookup_max_ngram: int = typer.Option(4, help="With --lookup: longest history suffix searched."),
    lookup_max_tokens: int | None = typer.Option(
        None,
        help="With --lookup: lookup tokens per step at most (mode `both`: the lookup row's length, "
        "default 24, at least block size - 1; other modes: default block size - 1).",
    ),
    fmt: str = typer.Option(
        "gptq",
        "--format",
        help="gptq (v1, default) | compressed-tensors | gguf (needs --group-size 32) | mlx (group 32/64/128).",
    ),
    gguf_type: str | None = typer.Option(
        None,
        help="With --format gguf: GPTQ directly on llama.cpp's grids: a pure type (Q6_K | Q5_K | Q4_K | Q3_K | Q2_K | IQ4_NL, "
        "= llama-quantize --pure) or llama-quantize's per-tensor mix (Q4_K_M | Q4_K_S | Q3_K_M | Q3_K_S | Q3_K_L | "
        "Q2_K_S | Q2_K_MIX = its Q2_K | Q5_K_M | Q5_K_S); ignores --bits/--group-size/--sym.",
    ),
    gguf_scale_search: int = typer.Option(
        2,
        help="With --gguf-type: each sub-block's integer scale/min is re-chosen within +-N of the weighted fit by "
        "the GPTQ loss when GPTQ reaches it (Hessian in the loop); 0 = the weighted fit alone.",
    ),
    max_tau_loss: float | None = typer.Option(
        None,
        help="Mixed precision: per-Linear bits/group for the fewest bytes whose predicted tau ratio is >= 1 - this "
        "(0.01: 99 percent of bf16 tau; the loss -> tau map is measured on the first calibration prompts).",
    ),
    max_bytes: str | None = typer.Option(
        None,
        help="Mixed precision: the best predicted acceptance with the whole drafter within this size (e.g. 900KB).",
    ),
    max_bits_per_weight: float | None = typer.Option(
        None,
        help="Mixed precision: the best predicted acceptance with the quantized Linears at most this many bits per "
        "weight in codes, scales and zeros (3.25: 3-bit g128 plus a few wider Linears).",
    ),
    fit: str | None = typer.Option(
        None, help="Mixed precision: the best acceptance that fits this GPU (rtx4090, h100, 24GB) next to the target."
    ),
    context: int | None = typer.Option(None, help="With --fit: context length served (target and drafter caches)."),
    target_weights: str | None = typer.Option(
        None,
        help="With --fit: the target's weight form in the budget (bf16|fp8|int8|int4 or a size); default from files.",
    ),
    spec_tokens: int | None = typer.Option(
        None, help="With --fit: K drafted tokens per step to budget for; default: searched from block_size - 1 down."
    ),
    kv_dtype: str | None = typer.Option(
        None, help="With --fit: KV cache dtype auto|bf16|fp16|fp8 (vLLM --kv-cache-dtype); default: searched."
    ),
    drafter_kv_dtype: str | None = typer.Option(None, help="With --fit: the drafter's KV dtype (default: --kv-dtype)."),
    state_dtype: str | None = typer.Option(
        None,
        help="With --fit: recurrent state dtype auto|bf16|fp32 (vLLM --mamba-ssm-cache-dtype); default: searched.",
    ),
    prefix_caching: bool | None = typer.Option(
        None,
        "--prefix-caching/--no-prefix-caching",
        help="With --fit: vLLM prefix caching (2 + K state pages per request, else 1 + K); default: searched.",
    ),
    gpu_memory_utilization: float | None = typer.Option(
        None, help="With --fit: vLLM --gpu-memory-utilization (default 0.90; never raised by the search)."
    ),
    cuda_graphs: str | None = typer.Option(
        None, help="With --fit: CUDA-graph reserve (default 0.5GiB; 0 = --enforce-eager; never dropped by the search)."
    ),
    mix_dev_prompts: int = typer.Option(32, help="Mixed precision: calibration prompts measured for the tau map."),
    mix_dev_new_tokens: int = typer.Option(64, help="Mixed precision: tokens per prompt for the tau map."),
) -> None:
    """Calibrate on the drafter's own inputs, GPTQ-quantize it, export GPTQ v1, and prove acceptance parity."""
    # The job is built from the flags here and checked, guarded and run by run_gptq: torch loads only after the
    # checks and the output lock, so refusals are instant.
    from dflash_quant.io.atomic import Terminated
    from dflash_quant.memory.fit import ServingKnobs
    from dflash_quant.models.placement import make_placement
    from dflash_quant.pipeline.job import GptqJob, RunState
    from dflash_quant.pipeline.run import run_gptq
    from dflash_quant.quantize.settings import QuantSettings

    placement = make_placement(device_map, max_memory)  # the map's syntax and devices
    serving = ServingKnobs(
        spec_tokens, kv_dtype, drafter_kv_dtype, state_dtype, prefix_caching, gpu_memory_utilization, cuda_graphs
    )
    goal = None
    if (
        max_tau_loss is not None or max_bytes is not None or max_bits_per_weight is not None or fit is not None
        or context is not None or target_weights or serving.given()
    ):  # fmt: skip
        from dflash_quant.quantize.mixed_plan import MixedGoal  # torch: only for a mixed-precision job

        goal = MixedGoal(
            max_tau_loss=max_tau_loss,
            max_bytes=None if max_bytes is None else parse_bytes(max_bytes, what="--max-bytes"),
            max_bits_per_weight=max_bits_per_weight,
            fit_gpu=fit,
            context=context,
            target_weights=target_weights,
            dev_prompts=mix_dev_prompts,
            dev_max_new_tokens=mix_dev_new_tokens,
            serving=serving,
        )
    look = None
    if lookup:
        from dflash_quant.speculative.lookup import LookupSettings  # torch: only with --lookup

        look = LookupSettings(lookup_mode, lookup_min_ngram, lookup_max_ngram, lookup_max_tokens)
    job = GptqJob(
        output=output,
        drafter=drafter,
        target=target,
        quant=QuantSettings(
            method=method,
            bits=bits,
            group_size=group_size,
            sym=sym,
            desc_act=desc_act,
            static_groups=static_groups,
            clip_search=clip_search,
            damp=damp,
            sequential=sequential,
            profile=profile,
            skip=tuple(skip),
            quantize_conv=quantize_conv,
            quantize_selector=quantize_selector,
            tune_epochs=tune_epochs,
            tune_lr=tune_lr,
            tune_codes=tune_codes,
            tune_code_travel=tune_code_travel,
            tune_anchor=tune_anchor,
            tune_position_decay=tune_position_decay,
            tune_rows=tune_rows,
            tune_target=tune_target,
            tune_norms=tune_norms,
        ),
        overwrite=overwrite,
        calib_prompts=calib_prompts,
        calib_num_prompts=num_prompts,
        calib_max_new_tokens=max_new_tokens,
        kv_hessian=kv_hessian,
        calib_cache=calib_cache,
        calib_store=None if no_calib_cache else calib_store_dir(),
        calib_store_max_bytes=int(calib_cache_max_gb * 1e9),
        verify=verify,
        eval_prompts=eval_prompts,
        eval_num_prompts=eval_num_prompts,
        eval_max_new_tokens=eval_max_new_tokens,
        tolerance=tolerance,
        device=device,
        dtype=dtype,
        chat_template=chat_template,
        write_card=card,
        format=fmt,
        # a --check-cache given here is an input too (never overwritten); the default one lies in ~/.cache
        check_cache=None if no_check_cache else (check_cache or check_cache_dir()),
        full_baseline=full_baseline,
        check_batch=check_batch,
        calib_batch=calib_batch,
        teacher_forced=teacher_forced,
        command=["dflash-quant", *sys.argv[1:]],
        lookup=look,
        gguf_type=gguf_type,
        gguf_scale_search=gguf_scale_search,
        placement=placement,
        hessian_device=hessian_device,
        gpu_memory_limit=parse_bytes(gpu_memory_limit, what="--gpu-memory-limit") if gpu_memory_limit else None,
        calib_checkpoint_every=calib_checkpoint_every,
        int4_kernel=int4_kernel,
        mixed=goal,
    )
    bar = progress_bar()

    def stage(label: str, total: int | None):
        return stage_progress(bar, label, total)

    state = RunState()
    try:
        result = run_gptq(job, progress=stage, state=state)
    except (Exception, Terminated, KeyboardInterrupt) as exc:
        stop = as_stop(exc)
        if stop is None:
            raise
        bar.stop()
        _stopped(stop, state.kept_checkpoint)
    finally:
        bar.stop()
    if json_out:
        print_json(
            {
                "output": str(result.output),
                "passed": result.passed,
                "reasons": result.reasons,
                "parity": result.parity,
                "quant_report": result.quant_report,
                "timings": result.timings,
                "calibration": result.calibration,
                "target_quantization": result.target_quantization,
            }
        )
    else:
        out_console.print(_summary(result))
        out_console.print(f"artifact: {result.output}", highlight=False, soft_wrap=True)
    for line in (result.parity or {}).get("notes", []):
        note(line)
    tuned_on = ((result.quant_report or {}).get("tuning") or {}).get("prompts")
    if tuned_on is not None and tuned_on < TUNE_MIN_PROMPTS:
        note(
            f"gptq-kl was tuned on {tuned_on} calibration prompts; on the shipped pairs "
            f"~{TUNE_MIN_PROMPTS}+ tuned better for prompts like the drafter's training data (docs/quality.md): "
            "give more with --calib-prompts"
        )
    if goal is not None:  # the plan's caveats and, for --fit, the serving settings it was sized for, on stderr
        from dflash_quant.artifact.reports import Provenance
        from dflash_quant.pipeline.mixed_stage import fit_line

        prov = Provenance.read(result.output, optional=True)
        mixed = prov.mixed if prov is not None else None
        for line in (mixed.notes if mixed is not None else None) or []:
            note(line)
        if mixed is not None and mixed.serving is not None:
            err_console.print("fit: " + fit_line(mixed.serving), markup=False, highlight=False, soft_wrap=True)
    if result.passed is False:
        note(f"{'; '.join(result.reasons)} (artifact kept for inspection)", tag="parity gate failed:", style="red")
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    app.command("gptq")(gptq)
