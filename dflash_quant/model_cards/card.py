"""Model card (README.md with Hub metadata) for a quantized-drafter artifact.

Every number in the card is read from the artifact's own reports (provenance.json, quant_report.json,
parity.json, memory.json, config.json). A report that is missing or unreadable makes its section say
"not measured" instead of inventing a value.
"""

from __future__ import annotations

import contextlib
import json
import re
import shlex
from pathlib import Path
from typing import Any

from huggingface_hub import ModelCard, ModelCardData
from huggingface_hub.repocard import metadata_load

from dflash_quant import __version__
from dflash_quant.artifact.files import replace_atomic
from dflash_quant.artifact.reports import Budget, MemoryReport, Parity, Provenance, QuantReport, SourceRef
from dflash_quant.artifact.sources import portable_command
from dflash_quant.errors import DFlashQuantError
from dflash_quant.export.atomic import signals_raise
from dflash_quant.export.manifest import has_manifest, record_files, require_intact, updating
from dflash_quant.model_cards.chart import CHART_NAME, MIX_CHART_NAME, write_acceptance_chart, write_tradeoff_chart

README = "README.md"
REPORT_CLASSES = (Provenance, QuantReport, Parity, MemoryReport)
REPORTS = tuple(c.FILE for c in REPORT_CLASSES) + ("config.json",)
NOT_MEASURED = "not measured"
DEFAULT_LIBRARY = "transformers"
DEFAULT_PIPELINE_TAG = "text-generation"
PLACEHOLDER_REPO = "<this-repo-id>"

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_CACHE_DIR = re.compile(r"^models--([^/]+?)--(.+)$")
_TOKENISH = re.compile(r"hf_[A-Za-z0-9]{16,}")
_SECRET_FLAGS = {"--token", "--hf-token", "--api-key"}


# --------------------------------------------------------------------------- reading


def _read_config(path: Path) -> tuple[dict | None, str | None]:
    """config.json (not one of the reports): (data, problem), data None when missing or unreadable."""
    if not path.is_file():
        return None, "missing"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        return None, f"unreadable ({exc.__class__.__name__})"
    if not isinstance(data, dict):
        return None, "not a JSON object"
    return data, None


def load_reports(artifact_dir: Path) -> tuple[dict[str, Any], dict[str, str]]:
    """The typed reports (artifact.reports) and config.json; a missing or malformed one is None, with its problem."""
    reports: dict[str, Any] = {}
    problems: dict[str, str] = {}
    for cls in REPORT_CLASSES:
        report, problem = cls.problem(Path(artifact_dir))
        reports[cls.FILE] = report
        if problem:
            problems[cls.FILE] = problem.removeprefix("is ")
    reports["config.json"], problem = _read_config(Path(artifact_dir) / "config.json")
    if problem:
        problems["config.json"] = problem
    return reports, problems


def _get(d: Any, *keys: str, default: Any = None) -> Any:
    for key in keys:
        if not isinstance(d, dict) or key not in d:
            return default
        d = d[key]
    return default if d is None else d


def is_hub_id(value: str | None) -> bool:
    if not value:
        return False
    return bool(_HUB_ID.match(value)) and not Path(value).exists()


def _hub_id_from_path(value: str) -> str | None:
    """`.../models--org--name/snapshots/<sha>` (the HF cache layout) -> `org/name`."""
    for part in Path(value).parts:
        m = _CACHE_DIR.match(part)
        if m:
            return f"{m.group(1)}/{m.group(2)}"
    return None


def resolve_source(provenance: Provenance | None) -> dict[str, Any]:
    """Source drafter id, its Hub repo (Hub sources only), and the metadata of its own card when available.

    License and library are inherited from the source card only when a copy of that card is on disk
    (a local source directory or the local HF cache); no network call is made here. Shipped and local
    sources have no Hub repo, so no `base_model` and no link.
    """
    src = provenance.source_drafter if provenance and provenance.source_drafter else SourceRef()
    sid = src.id
    out: dict[str, Any] = {
        "id": sid,
        "kind": src.kind,
        "revision": src.revision,
        "sha256": src.sha256,
        "hub_id": src.hub_repo(),
        "metadata": {},
        "metadata_from": None,
    }
    if not sid:
        return out
    readme: Path | None = None
    local = Path(src.path or sid)
    if src.kind in (None, "local") and local.is_dir():
        if src.kind is None:  # written before `kind`: a path in the HF cache still names its repo
            out["hub_id"] = out["hub_id"] or _hub_id_from_path(str(local.resolve()))
        if (local / README).is_file():
            readme = local / README
    elif src.kind == "hub" or (src.kind is None and is_hub_id(sid)):
        out["hub_id"] = out["hub_id"] or sid
        try:
            from huggingface_hub import try_to_load_from_cache

            cached = try_to_load_from_cache(out["hub_id"], README, revision=src.revision)
            if isinstance(cached, str):
                readme = Path(cached)
        except Exception:  # a malformed revision or cache must never break the card
            readme = None
    if readme is not None:
        try:
            out["metadata"] = metadata_load(readme) or {}
            out["metadata_from"] = "the source drafter's card"
        except Exception:
            out["metadata"] = {}
    if src.license:
        out["metadata"] = {**out["metadata"], "license": src.license}
        out["metadata_from"] = out["metadata_from"] or "provenance.json"
    return out


def _scrub_command(argv: list[str]) -> list[str]:
    """Never put a secret or a machine-local absolute path from the command line into a card."""
    argv = portable_command(argv)
    clean: list[str] = []
    hide_next = False
    for arg in argv:
        arg = str(arg)
        if hide_next:
            clean.append("***")
            hide_next = False
            continue
        flag, eq, _ = arg.partition("=")
        if flag in _SECRET_FLAGS:
            if eq:
                clean.append(f"{flag}=***")
            else:
                clean.append(arg)
                hide_next = True
            continue
        clean.append(_TOKENISH.sub("***", arg))
    return clean


# --------------------------------------------------------------------------- formatting


def fmt_float(value: Any, digits: int = 3) -> str:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return NOT_MEASURED
    return f"{float(value):.{digits}f}"


def fmt_pct(value: Any, digits: int = 1) -> str:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return NOT_MEASURED
    return f"{float(value) * 100:.{digits}f}%"


def fmt_bytes(value: Any) -> str:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return NOT_MEASURED
    n = int(value)
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n:,} B ({n / size:.2f} {unit})"
    return f"{n:,} B"


def fmt_bool(value: Any) -> str:
    if value is True:
        return "yes"
    if value is False:
        return "**no**"
    return NOT_MEASURED


def _fmt_any(value: Any) -> str:
    if value is None:
        return NOT_MEASURED
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, (list, tuple)):
        return ", ".join(f"`{v}`" for v in value) if value else "none"
    if isinstance(value, dict):
        return ", ".join(f"{k}: {v}" for k, v in value.items()) if value else "none"
    return str(value)


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def _missing(name: str, problem: str, how: str) -> str:
    return f"_{NOT_MEASURED}: `{name}` is {problem} in this artifact ({how})._"


# --------------------------------------------------------------------------- sections


def _block_size(config: dict | None) -> int | None:
    value = _get(config, "block_size") or _get(config, "dflash_config", "block_size")
    return int(value) if isinstance(value, int) else None


def _quantized_modules(quant_report: dict | None) -> list[str]:
    return [str(layer.get("name")) for layer in _get(quant_report, "layers", default=[]) if isinstance(layer, dict)]


def _qkv_state(provenance: dict | None, quant_report: dict | None) -> str:
    """'bf16', 'quantized' or 'unknown' for the attention q/k/v projections."""
    names = _quantized_modules(quant_report)
    if names:
        return "quantized" if any(re.search(r"\.(q|k|v)_proj$", n) for n in names) else "bf16"
    skipped = _get(provenance, "quantization", "skipped")
    if isinstance(skipped, list):
        qkv_skipped = [s for s in skipped if re.search(r"(q|k|v)_proj", str(s))]
        return "bf16" if qkv_skipped else "unknown"
    return "unknown"


def _is_dflash2(config: dict | None) -> bool:
    archs = _get(config, "architectures", default=[]) or []
    return any("DFlash2" in str(a) for a in archs) or _get(config, "dflash_config", "conv_kernel_size") is not None


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
        "profile": _get(ctx["provenance"], "quantization", "profile"),
        "fc": state(r"^fc$"),
        "conv": state(r"kernel_projection$"),
        "selector": state(r"hidden_projection$"),
    }


def _section_summary(ctx: dict) -> str:
    src, prov, cfg = ctx["source"], ctx["provenance"], ctx["config"]
    bits = _get(prov, "quantization", "bits") or _get(cfg, "quantization_config", "bits")
    group = _get(prov, "quantization", "group_size") or _get(cfg, "quantization_config", "group_size")
    target_id = _get(prov, "target", "id")
    target_rev = _get(prov, "target", "revision")
    block = _block_size(cfg)
    lines = []
    what = f"GPTQ int{bits}" if bits else "GPTQ"
    if group:
        what += f" (group size {group})"
    source = f"`{src['id']}`" if src["id"] else "an unrecorded source drafter"
    if src["hub_id"]:
        source = f"[`{src['hub_id']}`](https://huggingface.co/{src['hub_id']})"
    lines.append(
        f"This is a {what} quantization of the DFlash speculative-decoding drafter {source}, made with "
        f"[dflash-quant](https://pypi.org/project/dflash-quant/) {_get(prov, 'tool_version', default=__version__)}."
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
    tq = _get(prov, "target_quantization")
    if isinstance(tq, dict) and tq.get("format"):
        from dflash_quant.target_quant import target_quant_label

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


def _section_recipe(ctx: dict) -> str:
    prov, cfg, qr = ctx["provenance"], ctx["config"], ctx["quant_report"]
    out = ["## Quantization recipe", ""]
    q = _get(prov, "quantization", default=None)
    qc = _get(cfg, "quantization_config", default=None)
    if not q and not qc:
        out.append(
            _missing(
                "provenance.json", ctx["problems"].get("provenance.json", "incomplete"), "the recipe was not recorded"
            )
        )
    else:
        q = q or {}
        qc = qc or {}
        rows = [
            ["method", _fmt_any(q.get("method") or qc.get("quant_method"))],
            ["bits", _fmt_any(q.get("bits", qc.get("bits")))],
            ["group size", _fmt_any(q.get("group_size", qc.get("group_size")))],
            ["symmetric", _fmt_any(q.get("sym", qc.get("sym")))],
            ["act-order (desc_act)", _fmt_any(q.get("desc_act", qc.get("desc_act")))],
            ["static groups", _fmt_any(q.get("static_groups", qc.get("static_groups")))],
            ["dampening", _fmt_any(q.get("damp", qc.get("damp_percent")))],
            ["sequential", _fmt_any(q.get("sequential", qc.get("true_sequential")))],
            ["profile", _fmt_any(q.get("profile"))],
            ["kept in bf16 (skipped)", _fmt_any(q.get("skipped"))],
            ["checkpoint format", _fmt_any(qc.get("checkpoint_format"))],
        ]
        out.append(_table(["setting", "value"], rows))
    out += ["", "### Calibration data", ""]
    cal = _get(prov, "calibration", default=None)
    if not cal:
        out.append(
            _missing(
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
            _table(
                ["setting", "value"],
                [
                    ["prompts", _fmt_any(cal.get("prompts"))],
                    ["number of prompts", _fmt_any(cal.get("num_prompts"))],
                    ["max new tokens per prompt", _fmt_any(cal.get("max_new_tokens"))],
                    ["Hessian rows", rows_text],
                    ["context K/V inputs in the k/v Hessian", _fmt_any(cal.get("kv_hessian"))],
                    ["seed", _fmt_any(cal.get("seed"))],
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
            _missing(
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
        if errors:
            worst = max(errors, key=lambda e: e[0])
            mean = sum(e[0] for e in errors) / len(errors)
            rows.append(["relative output error, mean", fmt_float(mean, 4)])
            rows.append(["relative output error, worst", f"{fmt_float(worst[0], 4)} (`{worst[1]}`)"])
        out.append(_table(["", "value"], rows))
    return "\n".join(out)


def _section_parity(ctx: dict) -> str:
    parity = ctx["parity"]
    out = ["## Acceptance parity", ""]
    if parity is None:
        out.append(
            _missing(
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
            settings.append(f"{label} {_fmt_any(parity.get(key))}")
    out.append(
        f"Measured by dflash-quant's reference speculative loop ({', '.join(settings) or 'settings not recorded'}). "
        "tau (acceptance length) is the mean over steps of accepted drafts + 1 (the target's own token), "
        "range [1, block size]."
    )
    out.append("")
    out.append(
        _table(
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
        out.append(_table(["position k", "bf16", "quantized", "change"], rows))
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
                    _fmt_any(check.get("steps")),
                    _fmt_any(check.get("new_tokens")),
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
        out.append(
            _table(["drafter", "spec tok/s", "target-only tok/s", "speed-up", "steps", "new tokens"], speed_rows)
        )
        out += ["", _drafter_kernel_line(parity)]
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


def _drafter_kernel_line(parity: dict) -> str:
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


def _section_memory(ctx: dict) -> str:
    mem: MemoryReport | None = ctx["memory"]
    out = ["## Memory", ""]
    if mem is None:
        out.append(
            _missing(
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
    out.append(_table(["", "bf16", "quantized"], rows))
    out.append("")
    if baseline and isinstance(baseline.ratio, (int, float)):
        out.append(f"- Quantized / bf16 weight bytes: {fmt_float(baseline.ratio)}")
    elif not baseline:
        out.append(f"- bf16 baseline: {NOT_MEASURED} (memory.json has no baseline)")
    if mem.resident:
        r = mem.resident
        out.append(f"- Resident after loading on {_fmt_any(r.device)}: {fmt_bytes(r.bytes)} ({_fmt_any(r.method)})")
    if mem.context_kv_bytes_per_token is not None:
        out.append(f"- Drafter context K/V cache: {fmt_bytes(mem.context_kv_bytes_per_token)} per committed token")
    if weights and weights.by_dtype:
        out += ["", _table(["dtype", "bytes"], [[k, fmt_bytes(v)] for k, v in weights.by_dtype.items()])]
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
    target = f"`{t.source}` ({_fmt_any(t.weight_format)} weights, {fmt_bytes(t.weight_bytes)})" if t else "the target"
    setup = (
        f"context {_fmt_any(st.context)} tokens, {_fmt_any(st.concurrency)} request(s), "
        f"{_fmt_any(st.spec_tokens)} draft tokens per step"
        if st
        else "settings not recorded"
    )
    lines = [f"Target {target} with this drafter on {gpu}{gpu_bytes}, engine {_fmt_any(budget.engine)}, {setup}:", ""]

    def ctx_text(x) -> str:
        if x.max_context is None:
            return "none"
        limit = f" (limited by {x.max_context_limited_by})" if x.max_context_limited_by not in (None, "memory") else ""
        return f"{x.max_context:,} tokens{limit}"

    lines.append(
        _table(
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


def _mtp_comparison(ctx: dict) -> dict | None:
    mem: MemoryReport | None = ctx.get("memory")
    budget = mem.budget_24gb if mem is not None else None
    cmp = budget.compare_mtp if budget is not None else None
    return cmp if isinstance(cmp, dict) and isinstance(cmp.get("methods"), dict) and cmp["methods"] else None


def _section_mtp_comparison(ctx: dict) -> str:
    """The target ships an MTP head: this drafter against it, from memory.json's budget (`budget --compare-mtp`)."""
    cmp = _mtp_comparison(ctx)
    assert cmp is not None  # the card adds this section only when there is a comparison
    budget = ctx["memory"].budget_24gb
    gpu = budget.gpu.name if budget.gpu else None
    methods = cmp["methods"]
    names = list(methods)
    out = ["### MTP or DFlash on this card", "",
           f"The target ships an MTP head. Budget on {_fmt_any(gpu)} at {_fmt_any(cmp.get('context'))} tokens, "
           f"engine {_fmt_any(cmp.get('engine'))} (from `memory.json`, as `dflash-quant budget --compare-mtp` prints it):",
           ""]  # fmt: skip
    first = methods[names[0]]
    terms = list(first.get("components", {}))
    rows = [["state slots (1 or 2 + K)", *[_fmt_any(methods[n].get("state_slots")) for n in names]]]
    rows += [[t.replace("_", " "), *[fmt_bytes(methods[n]["components"].get(t)) for n in names]] for t in terms]
    rows += [["headroom", *[fmt_bytes(methods[n].get("headroom_bytes")) for n in names]],
             ["fits", *[{True: "yes", False: "no"}.get(methods[n].get("fits"), "?") for n in names]],
             ["max context (1 request)", *[_fmt_any(methods[n].get("max_context")) for n in names]],
             [f"max concurrency at {_fmt_any(cmp.get('context'))}", *[_fmt_any(methods[n].get("max_concurrency")) for n in names]],
             ["per request, speculation", *[fmt_bytes(methods[n].get("per_request_speculation_bytes")) for n in names]]]  # fmt: skip
    out.append(_table(["", *[methods[n].get("label", n) for n in names]], rows))
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
    qr_parts = _get(ctx["quant_report"], "by_part", default=None)
    if isinstance(qr_parts, dict) and isinstance(qr_parts.get("bf16"), dict):
        bf16, quant = qr_parts["bf16"], qr_parts.get("quantized") or {}
        totals = [_get(ctx["quant_report"], "drafter_bytes_bf16"), _get(ctx["quant_report"], "drafter_bytes_quantized")]
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
    out.append(_table(["part", "bf16", "this artifact"], rows))
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


def _section_serving(ctx: dict) -> str:
    cfg, prov, qr = ctx["config"], ctx["provenance"], ctx["quant_report"]
    repo = ctx["repo_id"] or PLACEHOLDER_REPO
    target = _get(prov, "target", "id") or "<target-model-id>"
    block = _block_size(cfg)
    n_spec = block - 1 if block else 15
    qkv = _qkv_state(prov, qr)
    spec_cfg = json.dumps({"method": "dflash", "model": repo, "num_speculative_tokens": n_spec})
    out = ["## Serving", ""]
    if repo == PLACEHOLDER_REPO:
        out.append(f"Replace `{PLACEHOLDER_REPO}` with this repository's id (or a local path to it).")
        out.append("")
    fmt = _get(cfg, "quantization_config", "quant_method") or (
        "mlx" if isinstance(_get(cfg, "quantization"), dict) else "gptq"
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
        gguf_file = _get(cfg, "quantization_config", "file") or "drafter.gguf"
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


def _section_limitations(ctx: dict) -> str:
    parity = ctx["parity"] or {}
    out = ["## Limitations", ""]
    temp = parity.get("temperature")
    n = parity.get("num_prompts")
    out.append(
        "- Acceptance was measured "
        + (
            f"at temperature {_fmt_any(temp)} on {_fmt_any(n)} prompts ({_fmt_any(parity.get('prompt_set'))})"
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


def _section_reproduce(ctx: dict) -> str:
    prov = ctx["provenance"]
    out = ["## How this was made", ""]
    argv = ctx["command"] or _get(prov, "command")
    if isinstance(argv, list) and argv:
        out += ["```bash", shlex.join(_scrub_command([str(a) for a in argv])), "```"]
    else:
        out.append(f"Command line: {NOT_MEASURED} (provenance.json does not record it).")
    out.append("")
    out.append(
        f"Tool: {_get(prov, 'tool', default='dflash-quant')} {_get(prov, 'tool_version', default='version not recorded')}"
        + (f", created {prov['created_utc']} (UTC)" if _get(prov, "created_utc") else "")
        + f". Card written by dflash-quant {__version__}."
    )
    out.append("")
    out.append("`manifest.json` lists the sha256 and size of every file in this repository.")
    return "\n".join(out)


# --------------------------------------------------------------------------- card


def build_card(
    artifact_dir: Path,
    *,
    command: list[str] | None = None,
    repo_id: str | None = None,
    chart: bool | None = None,
    mix_chart: bool | None = None,
) -> ModelCard:
    artifact_dir = Path(artifact_dir)
    reports, problems = load_reports(artifact_dir)
    source = resolve_source(reports["provenance.json"])
    view = {name: (r.to_dict() if r is not None else None) for name, r in reports.items() if name != "config.json"}
    prov, cfg = view["provenance.json"], reports["config.json"]
    meta = source["metadata"]
    bits = _get(prov, "quantization", "bits") or _get(cfg, "quantization_config", "bits")

    license_value = meta.get("license") if isinstance(meta.get("license"), str) else None
    if license_value:
        where = "provenance.json" if source["metadata_from"] == "provenance.json" else "the source drafter's card"
        license_note = (
            f"`{license_value}`, inherited from {where}; the quantized weights are a derivative of the source drafter"
        )
    else:
        license_note = (
            "not determined: the source drafter's card was not available when this card was written, "
            "so no license is declared in the metadata. The quantized weights are a derivative of the "
            "source drafter: check its license before use or redistribution"
        )

    tags = ["dflash", "speculative-decoding", "draft-model", "gptq"]
    mixed = bool(_get(prov, "mixed"))
    if mixed:  # `bits` is only the most common pick of a per-Linear mix
        tags.append("mixed-precision")
    elif isinstance(bits, int):
        tags.append(f"int{bits}")
    tags += ["quantized", "dflash-quant"]
    data_kwargs: dict[str, Any] = {}
    if source["hub_id"]:
        data_kwargs["base_model"] = source["hub_id"]
        data_kwargs["base_model_relation"] = "quantized"
    if license_value:
        data_kwargs["license"] = license_value
        for key in ("license_name", "license_link"):
            if isinstance(meta.get(key), str):
                data_kwargs[key] = meta[key]
    library = meta.get("library_name") if isinstance(meta.get("library_name"), str) else DEFAULT_LIBRARY
    card_data = ModelCardData(
        library_name=library,
        pipeline_tag=DEFAULT_PIPELINE_TAG,
        tags=tags,
        **data_kwargs,
    )

    has_chart = chart if chart is not None else (artifact_dir / CHART_NAME).is_file()
    ctx = {
        "source": source,
        "provenance": prov,
        "config": cfg,
        "quant_report": view["quant_report.json"],
        "parity": view["parity.json"],
        "memory": reports["memory.json"],
        "problems": problems,
        "command": command,
        "repo_id": repo_id,
        "chart": has_chart,
        "mix_chart": mix_chart if mix_chart is not None else (artifact_dir / MIX_CHART_NAME).is_file(),
        "license_note": license_note,
    }
    title_src = source["hub_id"] or (Path(source["id"]).name if source["id"] else artifact_dir.name)
    kind = "mixed precision" if mixed else (f"int{bits}" if bits else "")
    title = f"# {title_src.split('/')[-1]} — GPTQ {kind}".rstrip()
    if not source["hub_id"]:
        what = {"shipped": "is a model shipped with dflash-quant", "local": "is a local directory"}.get(
            source["kind"], "was not a Hugging Face Hub id"
        )
        base_note = (
            f"\n\n_The source drafter {what} (`{source['id'] or 'not recorded'}`), not a Hub repo, "
            "so `base_model` is not set in the metadata._"
        )
    else:
        base_note = ""
    body = "\n\n".join(
        [
            title,
            _section_summary(ctx) + base_note,
            _section_parity(ctx),
            _section_recipe(ctx),
            *([_section_mixed(ctx)] if _get(prov, "mixed") else []),
            _section_memory(ctx),
            *([_section_mtp_comparison(ctx)] if _mtp_comparison(ctx) else []),
            _section_serving(ctx),
            _section_limitations(ctx),
            _section_reproduce(ctx),
        ]
    )
    content = f"---\n{card_data.to_yaml()}\n---\n\n{body}\n"
    return ModelCard(content)


def _section_mixed(ctx: dict) -> str:
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
            + "): act-order / clip-search Linears count at theirs."
            if mix.get("solver_slopes")
            else ""
        ),
        "",
        _table(
            ["", "bytes (quantized Linears)", "summed error", "tau ratio"],
            [
                [
                    "this mix",
                    fmt_bytes(mix.get("predicted_bytes")),
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
              _table(["Linear", "setting"], [[f"`{n}`", s] for n, s in picks.items()])]  # fmt: skip
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
        out += ["", _table(["K", "changed", "drafter room", "bf16 tau at K", "predicted tau"], rows)]
    out += [f"- {n}" for n in fit.get("notes") or []]
    return out


def _write_mix_chart(artifact_dir: Path, parity) -> bool:
    prov = Provenance.read(artifact_dir, optional=True)
    path = artifact_dir / MIX_CHART_NAME
    mix = prov.mixed if prov is not None else None
    if mix is None or not mix.tau_calibration:
        if path.exists():
            path.unlink()
        return False
    uniform = [(str(p["setting"]), float(p["bytes"]), float(p["tau_ratio"])) for p in mix.tau_calibration]
    measured = parity.tau_ratio if parity is not None else None
    point = (float(mix.predicted_bytes or 0), mix.predicted_tau_ratio, measured)
    title = "Bytes vs acceptance: uniform GPTQ and the chosen mix"
    replace_atomic(path, lambda tmp: write_tradeoff_chart(tmp, uniform, point, title=title))
    return True


def _write_card_files(artifact_dir: Path, command: list[str] | None, repo_id: str | None) -> Path:
    parity, _ = Parity.problem(artifact_dir)
    chart_path = artifact_dir / CHART_NAME
    chart = False
    if parity is not None:
        base, quant = parity.baseline, parity.quantized
        pb = base.per_position_acceptance if base else None
        pq = quant.per_position_acceptance if quant else None
        if pb or pq:
            replace_atomic(
                chart_path,
                lambda tmp: write_acceptance_chart(
                    tmp,
                    pb,
                    pq,
                    baseline_tau=base.tau if base else None,
                    quantized_tau=quant.tau if quant else None,
                    title="Per-position acceptance: bf16 vs quantized drafter",
                ),
            )
            chart = True
    if not chart and chart_path.exists():
        chart_path.unlink()  # a stale chart from an earlier parity report must not outlive it
    mix_chart = _write_mix_chart(artifact_dir, parity)
    card = build_card(artifact_dir, command=command, repo_id=repo_id, chart=chart, mix_chart=mix_chart)
    return replace_atomic(artifact_dir / README, card.save)


def write_card(artifact_dir: Path, *, command: list[str] | None = None, repo_id: str | None = None) -> Path:
    """Render README.md (and acceptance.png when parity.json exists).

    With a manifest (a finished artifact), every file it records is checked first and a mismatch is
    refused; then only README.md and acceptance.png are recorded. Without one (inside the export's temp
    dir, before the export stage writes it) the manifest is left to the export.
    Returns the README path. Missing reports are tolerated: their sections say "not measured".
    """
    artifact_dir = Path(artifact_dir)
    if not artifact_dir.is_dir():
        raise DFlashQuantError(
            f"artifact directory {artifact_dir} does not exist; pass the --output of `dflash-quant gptq`"
        )
    manifest = has_manifest(artifact_dir)
    # a finished artifact is updated in place: one run at a time, and a signal removes the temp files
    with signals_raise(), updating(artifact_dir) if manifest else contextlib.nullcontext():
        if manifest:
            require_intact(artifact_dir, stage="card", skip=(README, CHART_NAME, MIX_CHART_NAME))
        readme = _write_card_files(artifact_dir, command, repo_id)
        if manifest:
            record_files(artifact_dir, (README, CHART_NAME, MIX_CHART_NAME))
    return readme
