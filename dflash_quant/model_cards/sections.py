"""The card's sections on what was measured: summary, parity, recipe, mixed precision, limitations, how to reproduce."""

from __future__ import annotations

import shlex
from typing import Any

from dflash_quant import __version__
from dflash_quant.artifact.reports import target_quant_label
from dflash_quant.model_cards.chart import CHART_NAME, MIX_CHART_NAME
from dflash_quant.model_cards.fmt import NOT_MEASURED, fmt_any, fmt_bool, fmt_bytes, fmt_float, fmt_pct, missing, table
from dflash_quant.model_cards.reading import block_size, dig, scrub_command


def section_summary(ctx: dict) -> str:
    src, prov, cfg = ctx["source"], ctx["provenance"], ctx["config"]
    bits = dig(prov, "quantization", "bits") or dig(cfg, "quantization_config", "bits")
    group = dig(prov, "quantization", "group_size") or dig(cfg, "quantization_config", "group_size")
    target_id = dig(prov, "target", "id")
    target_rev = dig(prov, "target", "revision")
    block = block_size(cfg)
    lines = []
    what = f"GPTQ int{bits}" if bits else "GPTQ"
    if group:
        what += f" (group size {group})"
    source = f"`{src['id']}`" if src["id"] else "an unrecorded source drafter"
    if src["hub_id"]:
        source = f"[`{src['hub_id']}`](https://huggingface.co/{src['hub_id']})"
    lines.append(
        f"This is a {what} quantization of the DFlash speculative-decoding drafter {source}, made with "
        f"[dflash-quant](https://pypi.org/project/dflash-quant/) {dig(prov, 'tool_version', default=__version__)}."
    )
    lines.append("")
    lines.append(
        "A DFlash drafter is not a standalone language model: it has no embedding table and no output head. "
        "It proposes a block of draft tokens from the hidden states of its **target** model and borrows the "
        "target's input embedding and LM head, and the target verifies the block in one forward pass. Greedy "
        "output stays exactly the target's; the drafter only changes how many tokens are accepted per step."
    )
    lines.append("")
    if target_id:
        rev = f" (revision `{target_rev}`)" if target_rev else ""
        lines.append(f"- **Target model (pair it with this one only):** `{target_id}`{rev}")
    else:
        lines.append(
            "- **Target model:** not recorded in provenance.json; use the target the source drafter was trained for"
        )
    tq = dig(prov, "target_quantization")
    if isinstance(tq, dict) and tq.get("format"):
        lines.append(f"- **Target quantization (calibrated and checked against this form):** {target_quant_label(tq)}")
    lines.append(
        f"- **Source drafter:** `{src['id'] or 'not recorded'}`"
        + (f" revision `{src['revision']}`" if src["revision"] else "")
        + (f", sha256 `{src['sha256']}`" if src["sha256"] else "")
    )
    if block:
        lines.append(f"- **Block size:** {block} (the drafter proposes {block - 1} tokens per step)")
    lines.append(
        "- **Checkpoint format:** GPTQ v1 (`qweight`/`qzeros`/`scales`/`g_idx`) in `model.safetensors`; "
        "layers that are not quantized stay bf16"
    )
    if ctx["license_note"]:
        lines.append(f"- **License:** {ctx['license_note']}")
    return "\n".join(lines)


def section_recipe(ctx: dict) -> str:
    prov, cfg, qr = ctx["provenance"], ctx["config"], ctx["quant_report"]
    out = ["## Quantization recipe", ""]
    q = dig(prov, "quantization", default=None)
    qc = dig(cfg, "quantization_config", default=None)
    if not q and not qc:
        out.append(
            missing(
                "provenance.json", ctx["problems"].get("provenance.json", "incomplete"), "the recipe was not recorded"
            )
        )
    else:
        q = q or {}
        qc = qc or {}
        rows = [
            ["method", fmt_any(q.get("method") or qc.get("quant_method"))],
            ["bits", fmt_any(q.get("bits", qc.get("bits")))],
            ["group size", fmt_any(q.get("group_size", qc.get("group_size")))],
            ["symmetric", fmt_any(q.get("sym", qc.get("sym")))],
            ["act-order (desc_act)", fmt_any(q.get("desc_act", qc.get("desc_act")))],
            ["static groups", fmt_any(q.get("static_groups", qc.get("static_groups")))],
            ["dampening", fmt_any(q.get("damp", qc.get("damp_percent")))],
            ["sequential", fmt_any(q.get("sequential", qc.get("true_sequential")))],
            ["profile", fmt_any(q.get("profile"))],
            ["kept in bf16 (skipped)", fmt_any(q.get("skipped"))],
            ["checkpoint format", fmt_any(qc.get("checkpoint_format"))],
        ]
        out.append(table(["setting", "value"], rows))
    out += ["", "### Calibration data", ""]
    cal = dig(prov, "calibration", default=None)
    if not cal:
        out.append(
            missing(
                "provenance.json",
                ctx["problems"].get("provenance.json", "without a calibration record"),
                "calibration data unknown",
            )
        )
    else:
        rows_per_layer = cal.get("rows")
        rows_text = NOT_MEASURED
        if isinstance(rows_per_layer, dict) and rows_per_layer:
            counts = [int(v) for v in rows_per_layer.values() if isinstance(v, (int, float))]
            if counts:
                rows_text = (
                    f"{min(counts):,} to {max(counts):,} per layer ({len(counts)} layers)"
                    if min(counts) != max(counts)
                    else f"{counts[0]:,} per layer ({len(counts)} layers)"
                )
        out.append(
            table(
                ["setting", "value"],
                [
                    ["prompts", fmt_any(cal.get("prompts"))],
                    ["number of prompts", fmt_any(cal.get("num_prompts"))],
                    ["max new tokens per prompt", fmt_any(cal.get("max_new_tokens"))],
                    ["Hessian rows", rows_text],
                    ["context K/V inputs in the k/v Hessian", fmt_any(cal.get("kv_hessian"))],
                    ["seed", fmt_any(cal.get("seed"))],
                ],
            )
        )
        out.append("")
        out.append(
            "Hessians come from the bf16 drafter's own inputs while it speculates with its target "
            "(not from plain text through the drafter)."
        )
    out += ["", "### Per-layer result", ""]
    if qr is None:
        out.append(
            missing(
                "quant_report.json", ctx["problems"].get("quant_report.json", "missing"), "no per-layer errors recorded"
            )
        )
    else:
        layers = [layer for layer in qr.get("layers", []) if isinstance(layer, dict)]
        fallbacks = [layer for layer in layers if layer.get("fallback")]
        errors: list[tuple[float, Any]] = [
            (layer["rel_output_error"], layer.get("name"))
            for layer in layers
            if isinstance(layer.get("rel_output_error"), (int, float))
        ]
        rows = [
            ["quantized Linear layers", f"{len(layers)}"],
            [
                "GPTQ fallbacks (RTN)",
                f"{len(fallbacks)}"
                + (": " + ", ".join(f"`{f['name']}` ({f['fallback']})" for f in fallbacks) if fallbacks else ""),
            ],
            ["original weight bytes (quantized layers)", fmt_bytes(qr.get("original_bytes"))],
            ["quantized weight bytes (quantized layers)", fmt_bytes(qr.get("quantized_bytes"))],
            [
                "quantization time",
                f"{fmt_float(qr.get('seconds'), 1)} s" if isinstance(qr.get("seconds"), (int, float)) else NOT_MEASURED,
            ],
        ]
        methods: dict[str, int] = {}
        for layer in layers:
            if isinstance(layer.get("method"), str):
                methods[layer["method"]] = methods.get(layer["method"], 0) + 1
        if methods:
            rows.append(["method per Linear", ", ".join(f"{m}: {n}" for m, n in sorted(methods.items()))])
        tuning = qr.get("tuning")
        if isinstance(tuning, dict):
            kl = f"{fmt_float(tuning.get('kl_before'), 4)} -> {fmt_float(tuning.get('kl_after'), 4)}"
            kept = " (no gain: GPTQ scales kept)" if tuning.get("kept_gptq_scales") else ""
            loss = tuning.get("loss") if isinstance(tuning.get("loss"), str) else "KL to the bf16 drafter"
            rows.append([f"scale tuning (gptq-kl), on the calibration inputs: {loss}", kl + kept])
            rows.append(
                [
                    "scale tuning: epochs, steps, time",
                    f"{fmt_any(tuning.get('epochs'))}, {fmt_any(tuning.get('steps'))}, "
                    f"{fmt_float(tuning.get('seconds'), 1)} s",
                ]
            )
        if errors:
            worst = max(errors, key=lambda e: e[0])
            mean = sum(e[0] for e in errors) / len(errors)
            rows.append(["relative output error, mean", fmt_float(mean, 4)])
            rows.append(["relative output error, worst", f"{fmt_float(worst[0], 4)} (`{worst[1]}`)"])
        out.append(table(["", "value"], rows))
    return "\n".join(out)


def section_parity(ctx: dict) -> str:
    parity = ctx["parity"]
    out = ["## Acceptance parity", ""]
    if parity is None:
        out.append(
            missing(
                "parity.json",
                ctx["problems"].get("parity.json", "missing"),
                "run `dflash-quant verify` or `dflash-quant gptq` to measure acceptance",
            )
        )
        return "\n".join(out)
    base = parity.get("baseline") if isinstance(parity.get("baseline"), dict) else {}
    quant = parity.get("quantized") if isinstance(parity.get("quantized"), dict) else {}
    ratio = parity.get("tau_ratio")
    if not isinstance(ratio, (int, float)) and isinstance(base.get("tau"), (int, float)) and base.get("tau"):
        if isinstance(quant.get("tau"), (int, float)):
            ratio = quant["tau"] / base["tau"]
    verdict = {True: "**passed**", False: "**FAILED**"}.get(parity.get("passed"), NOT_MEASURED)
    settings = []
    for key, label in (
        ("prompt_set", "prompt set"),
        ("num_prompts", "prompts"),
        ("max_new_tokens", "max new tokens"),
        ("temperature", "temperature"),
        ("block_size", "block size"),
    ):
        if parity.get(key) is not None:
            settings.append(f"{label} {fmt_any(parity.get(key))}")
    how = (
        "dflash-quant's reference speculative loop replayed against the target's greedy continuation, decoded "
        "once (teacher-forced: same tau at temperature 0, losslessness and speed not measured)"
        if parity.get("teacher_forced")
        else "dflash-quant's reference speculative loop"
    )
    out.append(
        f"Measured by {how} ({', '.join(settings) or 'settings not recorded'}). "
        "tau (acceptance length) is the mean over steps of accepted drafts + 1 (the target's own token), "
        "range [1, block size]."
    )
    out.append("")
    out.append(
        table(
            ["", "tau bf16", "tau quantized", "recovery %", "lossless (bf16 / quantized)"],
            [
                [
                    "this drafter",
                    fmt_float(base.get("tau")),
                    fmt_float(quant.get("tau")),
                    fmt_pct(ratio),
                    f"{fmt_bool(base.get('lossless'))} / {fmt_bool(quant.get('lossless'))}",
                ]
            ],
        )
    )
    out.append("")
    tol = parity.get("tolerance")
    out.append(
        f"Parity check: {verdict}"
        + (
            f" (tolerance {fmt_pct(tol)} tau loss; lossless: {fmt_bool(parity.get('lossless'))})"
            if isinstance(tol, (int, float))
            else ""
        )
    )
    reasons = parity.get("reasons") or []
    if reasons:
        out.append("")
        out += [f"- {r}" for r in reasons]
    pb = base.get("per_position_acceptance") or []
    pq = quant.get("per_position_acceptance") or []
    out += ["", "### Per-position acceptance", ""]
    if not pb and not pq:
        out.append(f"_{NOT_MEASURED}: parity.json has no per-position acceptance._")
    else:
        rows = []
        for k in range(max(len(pb), len(pq))):
            b = pb[k] if k < len(pb) else None
            q = pq[k] if k < len(pq) else None
            delta = (
                f"{(q - b) * 100:+.1f} pts"
                if isinstance(b, (int, float)) and isinstance(q, (int, float))
                else NOT_MEASURED
            )
            rows.append([str(k + 1), fmt_float(b), fmt_float(q), delta])
        out.append("Fraction of steps in which draft position k was accepted.")
        out.append("")
        out.append(table(["position k", "bf16", "quantized", "change"], rows))
        if ctx["chart"]:
            out += ["", f"![Per-position acceptance, bf16 vs quantized]({CHART_NAME})"]
    speed_rows = []
    for label, check in (("bf16", base), ("quantized", quant)):
        if any(isinstance(check.get(k), (int, float)) for k in ("spec_tokens_per_s", "speedup")):
            speed_rows.append(
                [
                    label,
                    fmt_float(check.get("spec_tokens_per_s"), 1),
                    fmt_float(check.get("baseline_tokens_per_s"), 1),
                    fmt_float(check.get("speedup"), 2),
                    fmt_any(check.get("steps")),
                    fmt_any(check.get("new_tokens")),
                ]
            )
    if speed_rows:
        out += [
            "",
            "### Speed in the reference loop",
            "",
            "Wall-clock numbers from the machine that ran the check; they are not engine throughput.",
            "",
        ]
        out.append(table(["drafter", "spec tok/s", "target-only tok/s", "speed-up", "steps", "new tokens"], speed_rows))
        out += ["", drafter_kernel_line(parity)]
        timed = base.get("spec_timed_prompts")
        if isinstance(timed, int):
            out += [
                "",
                f"spec tok/s is timed on the first {timed} prompts, decoded one by one as the target-only baseline "
                f"is; the other {base.get('spec_batched_prompts')} ran as rows of batches of up to "
                f"{base.get('spec_batch')} prompts (the same tokens and acceptance, timed only per batch; "
                "steps and new tokens count every prompt).",
            ]
    return "\n".join(out)


def drafter_kernel_line(parity: dict) -> str:
    """How the quantized drafter ran in the check (int4 kernel or dequantized) and its speed against bf16."""
    recorded = parity.get("drafter_kernel")
    kernel: dict = recorded if isinstance(recorded, dict) else {}
    name = kernel.get("kernel")
    if name is None:
        how = "The quantized drafter's kernel was not recorded (a check from an older version)."
    elif name == "dequant":
        how = f"The quantized drafter ran with its weights dequantized to {parity.get('dtype') or 'the compute dtype'}"
        how += f" ({kernel['reason']})." if kernel.get("reason") else "."
    else:
        how = f"The quantized drafter ran in int4: {kernel.get('linears')} Linears through the `{name}` kernel."
    ratio = parity.get("spec_speed_ratio")
    if isinstance(ratio, (int, float)):
        how += f" Its spec tok/s is {ratio:.2f}x the bf16 drafter's in the same check"
        cached = parity.get("cache")
        cache: dict = cached if isinstance(cached, dict) else {}
        how += (
            " (the bf16 run's time comes from an earlier run's cache)." if cache.get("bf16_drafter") == "hit" else "."
        )
    return how


def section_mixed(ctx: dict) -> str:
    """Per-Linear picks, how they were chosen, what each engine can load, and the bytes-vs-tau chart."""
    mix = ctx["provenance"]["mixed"]
    par = ctx["parity"] or {}
    cal = mix.get("tau_calibration") or []
    lines = [
        "## Mixed precision",
        "",
        f"Bits and group size were chosen per Linear by `{mix.get('goal')}` = `{mix.get('goal_value')}`: GPTQ at "
        f"each candidate ({', '.join(mix.get('candidates') or [])}) on the calibration Hessians gives each Linear's "
        "relative output error (`+act`: act-order with static groups, `+clip`: each group's range clipped by "
        "the weighted-error-optimal factor; both store plain GPTQ v1 tensors, no column permutation); "
        "an exact knapsack search picks one setting per Linear; the summed error is tied "
        f"to tau by uniform settings measured on development prompts ({mix.get('dev_prompts')}, not the held-out "
        "prompts of the parity check)."
        + (
            f" `max_tau_loss` planned on the map's slope bounds ({mix.get('slope_bounds')}, paired bootstrap over "
            f"the dev prompts): the loss budget from the upper one, no Linear below {mix.get('bits_floor')} bits."
            if mix.get("bits_floor") is not None
            else ""
        )
        + (
            " Each solver kind has its own slope [lower, fitted, upper] ("
            + ", ".join(f"{k}: {v}" for k, v in (mix.get("solver_slopes") or {}).items())
            + "): act-order / clip-search Linears count at theirs"
            + (
                "; a gptq-kl mix counts every Linear at kl's, fitted on the tuned points at or above the floor."
                if "kl" in (mix.get("solver_slopes") or {})
                else "."
            )
            if mix.get("solver_slopes")
            else ""
        )
        + "".join(f" Note: {n}." for n in mix.get("notes") or []),
        "",
        table(
            ["", "bytes (quantized Linears)", "summed error", "tau ratio"],
            [
                [
                    "this mix",
                    fmt_bytes(mix.get("predicted_bytes"))
                    + (
                        f" ({fmt_float(mix.get('bits_per_weight'), 3)} bits per weight without g_idx)"
                        if mix.get("bits_per_weight") is not None
                        else ""
                    ),
                    fmt_float(mix.get("predicted_loss"), 4),
                    f"{fmt_float(mix.get('predicted_tau_ratio'), 4)} predicted"
                    + (
                        f" ({fmt_float(mix.get('predicted_tau_ratio_low'), 4)} with the slope's upper bound)"
                        if mix.get("predicted_tau_ratio_low") is not None
                        else ""
                    )
                    + f"; {fmt_float(par.get('tau_ratio'), 4)} measured on {par.get('num_prompts', '-')} held-out prompts",
                ],
                *[
                    [
                        f"uniform {p['setting']}",
                        fmt_bytes(p.get("bytes")),
                        fmt_float(p.get("loss"), 4),
                        f"{fmt_float(p.get('tau_ratio'), 4)} on the dev prompts",
                    ]
                    for p in cal
                ],
            ],  # fmt: skip
        ),
    ]
    if ctx.get("mix_chart"):
        lines += ["", f"![bytes vs tau]({MIX_CHART_NAME})"]
    picks = mix.get("picks") or {}
    lines += ["", "Chosen setting per Linear (`bits/group_size`):", "",
              table(["Linear", "setting"], [[f"`{n}`", s] for n, s in picks.items()])]  # fmt: skip
    lines += _fit_lines(mix.get("serving"))
    conflicts = mix.get("vllm_fused_conflicts") or []
    near = mix.get("nearest_uniform")
    lines += [
        "",
        "**Where the mix loads.** GPTQModel and dflash-quant (`verify`) read the per-Linear `dynamic` overrides in "
        "`quantization_config`; `dflash-quant export --format compressed-tensors` writes one config group per "
        "setting. GGUF and MLX hold one setting for all Linears and are refused for this artifact: the nearest "
        f"uniform setting is `--bits {near.split('/')[0]} --group-size {near.split('/')[1]}`."
        if near
        else "",
    ]
    if conflicts:
        lines.append(
            "vLLM loads q/k/v as one `qkv_proj` and gate/up as one `gate_up_proj` with a single setting, and "
            "renames the drafter's layers, so its anchored rules do not match there; these fused groups are "
            f"split in this mix: {', '.join(f'`{c}`' for c in conflicts)}. For vLLM use the nearest uniform "
            "setting above."
        )
    return "\n".join(lines)


def _fit_lines(fit: dict | None) -> list[str]:
    """`--fit`: the serving settings the drafter was sized for, what the search changed, the flags to serve with."""
    if not fit:
        return []
    st = fit.get("settings") or {}
    changed = ", ".join(f"`{c}`" for c in fit.get("changed") or []) or "nothing (the given settings fit)"
    rows = [
        [f"K={o.get('spec_tokens')}", ", ".join(o.get("changed") or []) or "-", fmt_bytes(o.get("drafter_room")),
         fmt_float(o.get("tau_bf16_at_k"), 3), fmt_float(o.get("predicted_tau"), 3)]
        for o in fit.get("options") or []
    ]  # fmt: skip
    out = [
        "",
        f"**Sized for serving** on {fit.get('gpu')} at {fit.get('context')} tokens (target weights "
        f"{fit.get('target_weights') or 'from files'}; dflash-quant's vLLM budget, batch 1). The settings as given "
        f"left {fmt_bytes(fit.get('given_room'))} for the drafter; the search changed {changed} and leaves "
        f"{fmt_bytes(fit.get('drafter_room'))}: K={st.get('spec_tokens')}, KV `{st.get('kv_dtype')}`, recurrent "
        f"state `{st.get('state_dtype')}`, prefix caching {'on' if st.get('prefix_caching') else 'off'}. The bf16 "
        f"drafter keeps tau {fmt_float(fit.get('tau_bf16_at_k'), 3)} of {fmt_float(fit.get('tau_bf16_full'), 3)} "
        f"at this K on the development prompts (estimated from the full block's acceptance; measured drafting K "
        f"tokens: {fmt_float(fit.get('tau_bf16_at_k_measured'), 3)}); predicted tau with this mix "
        f"{fmt_float(fit.get('predicted_tau'), 3)}. "
        "Serve with exactly these flags (TARGET: the target model, DRAFTER: this drafter), or the budget does not hold:",
        "",
        "```bash",
        "vllm serve TARGET " + " \\\n  ".join(fit.get("engine_flags") or []),
        "```",
    ]
    if rows:
        out += ["", table(["K", "changed", "drafter room", "bf16 tau at K", "predicted tau"], rows)]
    out += [f"- {n}" for n in fit.get("notes") or []]
    return out


def section_limitations(ctx: dict) -> str:
    parity = ctx["parity"] or {}
    out = ["## Limitations", ""]
    temp = parity.get("temperature")
    n = parity.get("num_prompts")
    out.append(
        "- Acceptance was measured "
        + (
            f"at temperature {fmt_any(temp)} on {fmt_any(n)} prompts ({fmt_any(parity.get('prompt_set'))})"
            if ctx["parity"]
            else "**not at all** (parity.json is missing)"
        )
        + "; other domains and sampling temperatures can accept differently. A spread of about +-3% in "
        "tokens per step between runs is normal: repeat before believing a 2% difference."
    )
    out.append(
        "- The drafter only works with its target model; a different target (even a fine-tune) "
        "changes the hidden states and the mask-token embedding it relies on."
    )
    out.append(
        "- int4 saves memory; it only saves time with a kernel built for 16-row blocks (Marlin-class). "
        "Generic int4 kernels can be slower than bf16 at the drafter's batch shape."
    )
    out.append("- Memory numbers are estimates from dflash-quant's model of the engine, not engine measurements.")
    return "\n".join(out)


def section_reproduce(ctx: dict) -> str:
    prov = ctx["provenance"]
    out = ["## How this was made", ""]
    argv = ctx["command"] or dig(prov, "command")
    if isinstance(argv, list) and argv:
        out += ["```bash", shlex.join(scrub_command([str(a) for a in argv])), "```"]
    else:
        out.append(f"Command line: {NOT_MEASURED} (provenance.json does not record it).")
    out.append("")
    out.append(
        f"Tool: {dig(prov, 'tool', default='dflash-quant')} {dig(prov, 'tool_version', default='version not recorded')}"
        + (f", created {prov['created_utc']} (UTC)" if dig(prov, "created_utc") else "")
        + f". Card written by dflash-quant {__version__}."
    )
    out.append("")
    out.append("`manifest.json` lists the sha256 and size of every file in this repository.")
    return "\n".join(out)
