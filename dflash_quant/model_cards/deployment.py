"""The card's sections on running the drafter: memory, the 24 GB budget, the MTP comparison, serving engines."""

from __future__ import annotations

import json
import re
from typing import Any

from dflash_quant.artifact.reports import Budget, MemoryReport
from dflash_quant.model_cards.fmt import NOT_MEASURED, fmt_any, fmt_bytes, fmt_float, fmt_pct, missing, table
from dflash_quant.model_cards.reading import block_size, dig

PLACEHOLDER_REPO = "<this-repo-id>"


def _quantized_modules(quant_report: dict | None) -> list[str]:
    return [str(layer.get("name")) for layer in dig(quant_report, "layers", default=[]) if isinstance(layer, dict)]


def _qkv_state(provenance: dict | None, quant_report: dict | None) -> str:
    """'bf16', 'quantized' or 'unknown' for the attention q/k/v projections."""
    names = _quantized_modules(quant_report)
    if names:
        return "quantized" if any(re.search(r"\.(q|k|v)_proj$", n) for n in names) else "bf16"
    skipped = dig(provenance, "quantization", "skipped")
    if isinstance(skipped, list):
        qkv_skipped = [s for s in skipped if re.search(r"(q|k|v)_proj", str(s))]
        return "bf16" if qkv_skipped else "unknown"
    return "unknown"


def _is_dflash2(config: dict | None) -> bool:
    archs = dig(config, "architectures", default=[]) or []
    return any("DFlash2" in str(a) for a in archs) or dig(config, "dflash_config", "conv_kernel_size") is not None


def _layout(ctx: dict) -> dict[str, Any]:
    """What this artifact quantized, for the serving notes: variant, profile, and fc / conv / selector state."""
    names = _quantized_modules(ctx["quant_report"])
    known = bool(names)

    def state(pattern: str) -> str:
        if not known:
            return "unknown"
        return "quantized" if any(re.search(pattern, n) for n in names) else "bf16"

    return {
        "dflash2": _is_dflash2(ctx["config"]),
        "profile": dig(ctx["provenance"], "quantization", "profile"),
        "fc": state(r"^fc$"),
        "conv": state(r"kernel_projection$"),
        "selector": state(r"hidden_projection$"),
    }


def section_memory(ctx: dict) -> str:
    mem: MemoryReport | None = ctx["memory"]
    out = ["## Memory", ""]
    if mem is None:
        out.append(
            missing(
                "memory.json",
                ctx["problems"].get("memory.json", "missing"),
                "run `dflash-quant memory` on the artifact",
            )
        )
        return "\n".join(out)
    weights, baseline = mem.weights, mem.baseline
    rows = [
        [
            "weights in memory",
            fmt_bytes(baseline.total_bytes) if baseline else NOT_MEASURED,
            fmt_bytes(weights.total_bytes if weights else None),
        ],
        ["on disk", fmt_bytes(baseline.disk_bytes) if baseline else NOT_MEASURED, fmt_bytes(mem.disk_bytes)],
    ]
    out.append(table(["", "bf16", "quantized"], rows))
    out.append("")
    if baseline and isinstance(baseline.ratio, (int, float)):
        out.append(f"- Quantized / bf16 weight bytes: {fmt_float(baseline.ratio)}")
    elif not baseline:
        out.append(f"- bf16 baseline: {NOT_MEASURED} (memory.json has no baseline)")
    if mem.resident:
        r = mem.resident
        out.append(f"- Resident after loading on {fmt_any(r.device)}: {fmt_bytes(r.bytes)} ({fmt_any(r.method)})")
    if mem.context_kv_bytes_per_token is not None:
        out.append(f"- Drafter context K/V cache: {fmt_bytes(mem.context_kv_bytes_per_token)} per committed token")
    if weights and weights.by_dtype:
        out += ["", table(["dtype", "bytes"], [[k, fmt_bytes(v)] for k, v in weights.by_dtype.items()])]
    out += _parts_table(ctx, weights.to_dict() if weights else {}, baseline.to_dict() if baseline else None)
    out += ["", "### 24 GB budget", ""]
    out += _budget_lines(mem.budget_24gb)
    return "\n".join(out)


def _budget_lines(budget: Budget | None) -> list[str]:
    """The bf16 and quantized drafter side by side: fits, headroom, max context (memory.json's budget_24gb)."""
    if budget is None or not budget.budgets:
        return [f"_{NOT_MEASURED}: memory.json has no 24 GB budget (run `dflash-quant memory` with --budget-target)._"]
    forms = (["bf16"] if "bf16" in budget.budgets else []) + [f for f in budget.budgets if f != "bf16"]
    b = [budget.budgets[f] for f in forms]
    gpu = budget.gpu.name if budget.gpu and budget.gpu.name else "the GPU"
    gpu_bytes = f" ({fmt_bytes(budget.gpu.total_bytes)})" if budget.gpu and budget.gpu.total_bytes else ""
    t, st = budget.target, budget.settings
    target = f"`{t.source}` ({fmt_any(t.weight_format)} weights, {fmt_bytes(t.weight_bytes)})" if t else "the target"
    setup = (
        f"context {fmt_any(st.context)} tokens, {fmt_any(st.concurrency)} request(s), "
        f"{fmt_any(st.spec_tokens)} draft tokens per step"
        if st
        else "settings not recorded"
    )
    lines = [f"Target {target} with this drafter on {gpu}{gpu_bytes}, engine {fmt_any(budget.engine)}, {setup}:", ""]

    def ctx_text(x) -> str:
        if x.max_context is None:
            return "none"
        limit = f" (limited by {x.max_context_limited_by})" if x.max_context_limited_by not in (None, "memory") else ""
        return f"{x.max_context:,} tokens{limit}"

    lines.append(
        table(
            [""] + [f"{f} drafter" for f in forms],
            [
                ["drafter weights"] + [fmt_bytes((x.components or {}).get("drafter_weights")) for x in b],
                ["required"] + [fmt_bytes(x.required_bytes) for x in b],
                ["usable"] + [fmt_bytes(x.usable_bytes) for x in b],
                ["fits"] + [NOT_MEASURED if x.fits is None else "yes" if x.fits else "**no**" for x in b],
                ["headroom"] + [fmt_bytes(x.headroom_bytes) for x in b],
                ["max context"] + [ctx_text(x) for x in b],
            ],
        )
    )
    notes = list(dict.fromkeys(n for x in b for n in (x.notes or [])))
    lines += [""] + [f"- {n}" for n in notes] + ([""] if notes else [])
    lines.append(
        "This is an estimate from dflash-quant's memory model (`dflash-quant budget` gives the full "
        "breakdown), not a measurement in a serving engine."
    )
    return lines


def mtp_comparison(ctx: dict) -> dict | None:
    mem: MemoryReport | None = ctx.get("memory")
    budget = mem.budget_24gb if mem is not None else None
    cmp = budget.compare_mtp if budget is not None else None
    return cmp if isinstance(cmp, dict) and isinstance(cmp.get("methods"), dict) and cmp["methods"] else None


def section_mtp_comparison(ctx: dict) -> str:
    """The target ships an MTP head: this drafter against it, from memory.json's budget (`budget --compare-mtp`)."""
    cmp = mtp_comparison(ctx)
    assert cmp is not None  # the card adds this section only when there is a comparison
    budget = ctx["memory"].budget_24gb
    gpu = budget.gpu.name if budget.gpu else None
    methods = cmp["methods"]
    names = list(methods)
    out = ["### MTP or DFlash on this card", "",
           f"The target ships an MTP head. Budget on {fmt_any(gpu)} at {fmt_any(cmp.get('context'))} tokens, "
           f"engine {fmt_any(cmp.get('engine'))} (from `memory.json`, as `dflash-quant budget --compare-mtp` prints it):",
           ""]  # fmt: skip
    first = methods[names[0]]
    terms = list(first.get("components", {}))
    rows = [["state slots (1 or 2 + K)", *[fmt_any(methods[n].get("state_slots")) for n in names]]]
    rows += [[t.replace("_", " "), *[fmt_bytes(methods[n]["components"].get(t)) for n in names]] for t in terms]
    rows += [["headroom", *[fmt_bytes(methods[n].get("headroom_bytes")) for n in names]],
             ["fits", *[{True: "yes", False: "no"}.get(methods[n].get("fits"), "?") for n in names]],
             ["max context (1 request)", *[fmt_any(methods[n].get("max_context")) for n in names]],
             [f"max concurrency at {fmt_any(cmp.get('context'))}", *[fmt_any(methods[n].get("max_concurrency")) for n in names]],
             ["per request, speculation", *[fmt_bytes(methods[n].get("per_request_speculation_bytes")) for n in names]]]  # fmt: skip
    out.append(table(["", *[methods[n].get("label", n) for n in names]], rows))
    out += [
        "",
        "The per-request speculation cost is what each concurrent request adds over no speculation: "
        "mostly the 1 + K copies of the linear-attention state (2 + K with prefix caching). Estimates from dflash-quant's memory model.",
    ]
    return "\n".join(out)


_PART_LABELS = {
    "backbone_linears": "backbone Linears (attention, MLP)", "fc": "fc (target taps -> hidden)", "norms": "norms",
    "conv": "convolutions (base_kernel, kernel_projection)", "selector_codebooks": "selector codebooks",
    "selector_projection": "selector hidden_projection", "other": "other",
}  # fmt: skip


def _parts_table(ctx: dict, weights: dict, baseline: dict | None) -> list[str]:
    """Whole-drafter bytes by part: quant_report's (every source tensor at bf16 vs every written tensor),
    else memory.json's file-based counts."""
    qr_parts = dig(ctx["quant_report"], "by_part", default=None)
    if isinstance(qr_parts, dict) and isinstance(qr_parts.get("bf16"), dict):
        bf16, quant = qr_parts["bf16"], qr_parts.get("quantized") or {}
        totals = [dig(ctx["quant_report"], "drafter_bytes_bf16"), dig(ctx["quant_report"], "drafter_bytes_quantized")]
    else:
        bf16 = (baseline or {}).get("by_part") or {}
        quant = weights.get("by_part") or {}
        totals = [(baseline or {}).get("total_bytes"), weights.get("total_bytes")]
    if not isinstance(quant, dict) or not any(quant.values()):
        return []
    rows: list[list[str]] = [
        [str(_PART_LABELS.get(k, k)), str(fmt_bytes(bf16.get(k))) if bf16 else NOT_MEASURED, str(fmt_bytes(v))]
        for k, v in quant.items()
        if v or bf16.get(k)
    ]
    rows.append(
        ["**whole drafter**", str(fmt_bytes(totals[0])) if totals[0] else NOT_MEASURED, str(fmt_bytes(totals[1]))]
    )
    out = ["", "Whole drafter by part (every tensor of the source at bf16 vs every tensor written):", ""]
    out.append(table(["part", "bf16", "this artifact"], rows))
    codebooks, total = quant.get("selector_codebooks"), totals[1]
    if codebooks and isinstance(total, (int, float)) and total:
        out += [
            "",
            f"- The selector codebooks (vocab x rank x 2, bf16 in every engine) are "
            f"{fmt_pct(codebooks / total)} of this artifact's weights.",
        ]
    return out


def _serving_notes(lay: dict, qkv: str) -> tuple[list[str], list[str], list[str]]:
    """(general, vLLM, SGLang) notes for this artifact's variant and profile (field-notes sections 3, 5, 10)."""
    general: list[str] = []
    profile = lay["profile"]
    if profile == "vllm":
        general.append("- Made with `--profile vllm`: q/k/v kept bf16 for vLLM's fused context-KV precompute.")
    elif profile == "sglang":
        general.append(
            "- Made with `--profile sglang`: q/k/v and `fc` kept bf16 (SGLang builds `qkv_proj` "
            "unquantized and mis-loads a packed `fc`)."
        )
    elif profile == "full":
        general.append(
            "- Made with `--profile full` (every backbone Linear and `fc` quantized): stock vLLM needs "
            "`--profile vllm`, SGLang needs `--profile sglang`."
        )
    if lay["dflash2"]:
        general.append(
            "- **DFlash2:** every engine (vLLM, SGLang, MLX) keeps the convolutions (`base_kernel`, "
            "`kernel_projection`), the candidate selector (`predecessor_codebook`, `successor_codebook`, "
            "`hidden_projection`) and the norms in bf16. `base_kernel` and the codebooks are bf16 in this "
            "file whatever the flags (GPTQ applies to Linears, not to per-channel kernels or gathers)."
        )
        extras = [
            f"`{n}`"
            for n, k in (("kernel_projection", "conv"), ("hidden_projection", "selector"))
            if lay[k] == "quantized"
        ]
        if extras:
            general.append(
                f"- **Caveat:** this artifact packs {' and '.join(extras)} as GPTQ (`--quantize-conv` / "
                "`--quantize-selector`, for the smallest file). Engines build these layers unquantized and "
                "will not load them; dflash-quant's loader does. For an engine, re-quantize without those flags."
            )
        elif lay["conv"] == "bf16":
            general.append(
                "- `kernel_projection` and `hidden_projection` are bf16 here, as every engine expects "
                "(negative `dynamic` rules in `quantization_config` tell GPTQ loaders so)."
            )
        general.append(
            "- **DFlash2 needs a dense target `lm_head`:** the selector scores the top-k of the target "
            "head's logits over the full vocabulary (the codebooks' `vocab_size`), so serve the target "
            "with its dense, full-vocabulary head (no pruned or draft-vocabulary head)."
        )
    vllm: list[str] = []
    if qkv == "quantized":
        vllm.append(
            "- **Caveat:** this artifact quantizes the attention q/k/v projections. vLLM's fused context-KV "
            "precompute reads `qkv_proj.weight` directly, so stock vLLM crashes (`no attribute 'weight'`) or "
            "silently corrupts acceptance until upstream fixes land. Re-quantize with `--profile vllm` "
            "(q/k/v kept in bf16) for stock vLLM."
        )
    elif qkv == "bf16":
        vllm.append("- q/k/v are kept in bf16 in this artifact, as stock vLLM's fused context-KV precompute requires.")
    else:
        vllm.append("- Whether q/k/v are quantized is not recorded here; stock vLLM needs them in bf16.")
    sglang = [
        "- SGLang keeps `qkv_proj` unquantized; o_proj, MLP and fc follow this drafter's quant config."
        + (
            " This artifact's quantized q/k/v do not match that expectation: use `--profile sglang`."
            if qkv == "quantized"
            else ""
        )
    ]
    if lay["fc"] == "quantized":
        sglang.append(
            "- **Caveat:** `fc` is packed in this artifact. SGLang mis-loads a packed `fc` (open issue "
            "#39087: a W4A16 DFlash2 drafter accepted ~1.05 tokens per step instead of 5.25); for SGLang "
            "re-quantize with `--profile sglang`, which keeps `fc` bf16."
        )
    elif lay["fc"] == "bf16":
        sglang.append("- `fc` is bf16 here, which avoids SGLang's packed-`fc` mis-load (issue #39087).")
    sglang.append(
        "- Check that the acceptance length SGLang reports is close to the tau above before trusting a "
        "deployment (a quantized DFlash drafter has been seen at ~1.0 there)."
    )
    return general, vllm, sglang


def section_serving(ctx: dict) -> str:
    cfg, prov, qr = ctx["config"], ctx["provenance"], ctx["quant_report"]
    repo = ctx["repo_id"] or PLACEHOLDER_REPO
    target = dig(prov, "target", "id") or "<target-model-id>"
    block = block_size(cfg)
    n_spec = block - 1 if block else 15
    qkv = _qkv_state(prov, qr)
    spec_cfg = json.dumps({"method": "dflash", "model": repo, "num_speculative_tokens": n_spec})
    out = ["## Serving", ""]
    if repo == PLACEHOLDER_REPO:
        out.append(f"Replace `{PLACEHOLDER_REPO}` with this repository's id (or a local path to it).")
        out.append("")
    fmt = dig(cfg, "quantization_config", "quant_method") or (
        "mlx" if isinstance(dig(cfg, "quantization"), dict) else "gptq"
    )
    if fmt in ("gguf", "mlx"):
        return "\n".join(out + _serving_lines(fmt, cfg, target, repo))
    if fmt == "compressed-tensors":
        out += [
            "This artifact is compressed-tensors `pack-quantized` (converted from dflash-quant's GPTQ codes); "
            "vLLM and SGLang read its `quantization_config` directly.",
            "",
        ]
    general, vllm_notes, sglang_notes = _serving_notes(_layout(ctx), qkv)
    if general:
        out += general + [""]
    out += ["### vLLM", "", "```bash", f"vllm serve {target} \\", f"  --speculative-config '{spec_cfg}'", "```", ""]
    out.append(
        "- vLLM reads the drafter's own `quantization_config` (GPTQ v1; `gptq_marlin` needs sym, 4/8 bits, "
        "group -1/32/64/128, otherwise the slower `gptq` path)."
    )
    out += vllm_notes
    out.append(
        "- Draft-layer names are offset by the target's layer count inside vLLM: use regexes, not exact "
        "names, in any ignore list."
    )
    out += [
        "",
        "### SGLang",
        "",
        "```bash",
        f"python -m sglang.launch_server --model-path {target} \\",
        "  --speculative-algorithm DFLASH \\",
        f"  --speculative-draft-model-path {repo}",
        "```",
        "",
    ]
    out += sglang_notes
    out += ["", "### transformers / reference loop", ""]
    out.append(
        "The DFlash forward is not part of transformers; the drafter needs the DFlash modeling code "
        "(the source drafter's remote code or the `dflash` package) and a GPTQ kernel (GPTQModel) to run "
        "these tensors. The path this card's numbers come from is dflash-quant's own reference loop, "
        "`dflash-quant verify` (see `dflash-quant verify --help`)."
    )
    return "\n".join(out)


def _serving_lines(fmt: str, cfg: dict | None, target: str, repo: str) -> list[str]:
    """Serving commands for the GGUF (llama.cpp) and MLX (dflash-mlx) exports."""
    if fmt == "gguf":
        gguf_file = dig(cfg, "quantization_config", "file") or "drafter.gguf"
        return [
            "### llama.cpp",
            "",
            "```bash",
            f"python convert_hf_to_gguf.py {target} --outfile target.gguf   # the target, once",
            f"llama-server -m target.gguf -md {repo}/{gguf_file} --spec-type draft-dflash",
            "```",
            "",
            "- The GGUF follows llama.cpp's own DFlash conversion (arch `dflash`, no token embedding or output "
            "tensors: the target's are used; target layer ids stored +1) and carries the target's vocabulary.",
            "- Check the `draft acceptance ... mean len` that llama-server logs against the tau above.",
        ]
    return [
        "### MLX (dflash-mlx)",
        "",
        "```bash",
        f'dflash generate --model {target} --draft {repo} --prompt "..."',
        "```",
        "",
        "- MLX affine layout (`weight`/`scales`/`biases`, `quantization` in config.json) as `mx.quantize` writes it; "
        "mlx-lm loads it pre-quantized, so no on-load quantization (which needs Metal) is involved.",
    ]
