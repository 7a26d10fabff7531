"""Model card (README.md with Hub metadata) for a quantized-drafter artifact.

Every number in the card is read from the artifact's own reports (provenance.json, quant_report.json,
parity.json, memory.json, config.json). A report that is missing or unreadable makes its section say
"not measured" instead of inventing a value.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

from huggingface_hub import ModelCard, ModelCardData

from dflash_quant.artifact.manifest import has_manifest, record_files, require_intact, updating
from dflash_quant.artifact.reports import Parity, Provenance
from dflash_quant.errors import DFlashQuantError
from dflash_quant.io.atomic import replace_atomic, signals_raise
from dflash_quant.model_cards.chart import CHART_NAME, MIX_CHART_NAME, write_acceptance_chart, write_tradeoff_chart
from dflash_quant.model_cards.deployment import mtp_comparison, section_memory, section_mtp_comparison, section_serving
from dflash_quant.model_cards.reading import README, dig, load_reports, resolve_source
from dflash_quant.model_cards.sections import (
    section_limitations,
    section_mixed,
    section_parity,
    section_recipe,
    section_reproduce,
    section_summary,
)

DEFAULT_LIBRARY = "transformers"
DEFAULT_PIPELINE_TAG = "text-generation"


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
    bits = dig(prov, "quantization", "bits") or dig(cfg, "quantization_config", "bits")

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
    mixed = bool(dig(prov, "mixed"))
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
            section_summary(ctx) + base_note,
            section_parity(ctx),
            section_recipe(ctx),
            *([section_mixed(ctx)] if dig(prov, "mixed") else []),
            section_memory(ctx),
            *([section_mtp_comparison(ctx)] if mtp_comparison(ctx) else []),
            section_serving(ctx),
            section_limitations(ctx),
            section_reproduce(ctx),
        ]
    )
    content = f"---\n{card_data.to_yaml()}\n---\n\n{body}\n"
    return ModelCard(content)


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
