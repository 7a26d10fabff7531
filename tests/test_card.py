"""Model card: Hub metadata, numbers equal to the reports, 'not measured' for missing reports, the PNG."""

from __future__ import annotations

import json
import shutil

import pytest
from huggingface_hub import ModelCard

from dflash_quant.errors import DFlashQuantError
from dflash_quant.export.manifest import verify_manifest
from dflash_quant.model_cards.card import NOT_MEASURED, fmt_bytes, fmt_float, write_card
from hub_fixtures import SOURCE_ID, TARGET_ID, make_artifact

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    return make_artifact(tmp_path_factory.mktemp("card") / "art", big_bytes=0)


def test_metadata(artifact):
    card = ModelCard.load(artifact / "README.md")
    data = card.data
    assert data.base_model == SOURCE_ID
    assert data.to_dict()["base_model_relation"] == "quantized"
    assert data.library_name == "transformers"
    assert data.pipeline_tag == "text-generation"
    for tag in ("dflash", "speculative-decoding", "gptq", "int4"):
        assert tag in data.tags
    # Source card not available offline: no invented license, and the body says so.
    assert data.license is None
    assert "License:** not determined" in card.text


def test_numbers_match_reports(artifact):
    text = (artifact / "README.md").read_text()
    parity = json.loads((artifact / "parity.json").read_text())
    memory = json.loads((artifact / "memory.json").read_text())
    qr = json.loads((artifact / "quant_report.json").read_text())
    base, quant = parity["baseline"], parity["quantized"]
    row = f"| this drafter | {base['tau']:.3f} | {quant['tau']:.3f} | {parity['tau_ratio'] * 100:.1f}% | yes / yes |"
    assert row in text
    for k, (b, q) in enumerate(zip(base["per_position_acceptance"], quant["per_position_acceptance"]), start=1):
        assert f"| {k} | {b:.3f} | {q:.3f} | {(q - b) * 100:+.1f} pts |" in text
    assert f"| weights in memory | {fmt_bytes(memory['baseline']['total_bytes'])} | {fmt_bytes(memory['weights']['total_bytes'])} |" in text
    assert f"{memory['weights']['total_bytes']:,}" in text and f"{memory['baseline']['total_bytes']:,}" in text
    assert f"{memory['budget_24gb']['headroom_bytes']:,}" in text
    assert f"max context {memory['budget_24gb']['max_context']} tokens" in text
    assert f"{qr['quantized_bytes']:,}" in text and f"{qr['original_bytes']:,}" in text
    assert "Parity check: **passed**" in text
    assert TARGET_ID in text
    assert "--speculative-config" in text and "num_speculative_tokens\": 7" in text
    assert "q/k/v are kept in bf16" in text
    assert "dflash-quant gptq --drafter z-lab/Qwen3-8B-DFlash-b16" in text  # the producing command
    assert "![Per-position acceptance, bf16 vs quantized](acceptance.png)" in text


def test_png_and_manifest(artifact):
    png = (artifact / "acceptance.png").read_bytes()
    assert png.startswith(PNG_MAGIC) and b"IEND" in png[-16:]
    import matplotlib.image

    img = matplotlib.image.imread(artifact / "acceptance.png")
    assert img.shape[0] > 100 and img.shape[1] > 100
    assert verify_manifest(artifact) == []
    manifest = json.loads((artifact / "manifest.json").read_text())
    assert {"README.md", "acceptance.png"} <= set(manifest["files"])


def test_missing_reports_say_not_measured(tmp_path):
    art = make_artifact(tmp_path / "bare", big_bytes=0, parity=False, memory=False, quant_report=False, card=False)
    write_card(art)
    text = (art / "README.md").read_text()
    assert not (art / "acceptance.png").exists()
    assert f"_{NOT_MEASURED}: `parity.json` is missing" in text
    assert f"_{NOT_MEASURED}: `memory.json` is missing" in text
    assert f"_{NOT_MEASURED}: `quant_report.json` is missing" in text
    assert "![" not in text
    assert verify_manifest(art) == []
    # Only numbers that exist somewhere in the artifact: no tau at all.
    assert "tau bf16 |" not in text


def test_stale_chart_removed_when_parity_goes(tmp_path):
    art = make_artifact(tmp_path / "a", big_bytes=0)
    assert (art / "acceptance.png").exists()
    (art / "parity.json").unlink()
    # In a finished artifact a recorded file going missing is refused: nothing is rewritten.
    with pytest.raises(DFlashQuantError, match="parity.json is listed in the manifest but missing"):
        write_card(art)
    assert (art / "acceptance.png").exists()
    # Inside the export (no manifest yet) the card drops the stale chart.
    (art / "manifest.json").unlink()
    write_card(art)
    assert not (art / "acceptance.png").exists()
    assert not (art / "manifest.json").exists()


def test_failing_parity_shown(tmp_path):
    art = make_artifact(tmp_path / "f", big_bytes=0, parity_passed=False)
    text = (art / "README.md").read_text()
    assert "Parity check: **FAILED**" in text
    assert "below 0.97" in text


def test_license_inherited_from_local_source(tmp_path):
    src = tmp_path / "src-drafter"
    src.mkdir()
    (src / "README.md").write_text("---\nlicense: mit\nlibrary_name: transformers\n---\n# drafter\n")
    art = make_artifact(tmp_path / "l", big_bytes=0, source_id=str(src), card=False)
    write_card(art, command=["dflash-quant", "gptq", "--token", "hf_secretsecretsecretsecret"], repo_id="me/d-int4")
    card = ModelCard.load(art / "README.md")
    assert card.data.license == "mit"
    assert card.data.base_model is None  # a local path is not a Hub id
    assert "base_model` is not set" in card.text
    assert "hf_secretsecret" not in card.text and "--token '***'" in card.text
    assert '"model": "me/d-int4"' in card.text


def test_license_from_hf_cache_layout(tmp_path):
    snap = tmp_path / "hub" / "models--z-lab--Qwen3-4B-DFlash-b16" / "snapshots" / "abc"
    snap.mkdir(parents=True)
    (snap / "README.md").write_text("---\nlicense: apache-2.0\n---\n")
    art = make_artifact(tmp_path / "c", big_bytes=0, source_id=str(snap))
    data = ModelCard.load(art / "README.md").data
    assert data.base_model == "z-lab/Qwen3-4B-DFlash-b16"
    assert data.license == "apache-2.0"


def test_fmt_helpers():
    assert fmt_float(None) == NOT_MEASURED
    assert fmt_bytes(1536) == "1,536 B (1.50 KiB)"
