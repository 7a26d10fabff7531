"""Model card: built from a real pipeline run on the shipped reference pair (conftest.reference_artifact), plus
hand-made artifacts for the branches a real run does not take (missing reports, Hub and local sources)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys

import pytest
from hub_fixtures import SOURCE_ID, TARGET_ID, make_artifact
from huggingface_hub import ModelCard

from dflash_quant.artifact.manifest import load_manifest, verify_manifest
from dflash_quant.artifact.reports import MemoryReport, Parity, Provenance, QuantReport
from dflash_quant.errors import DFlashQuantError
from dflash_quant.model_cards.card import write_card
from dflash_quant.model_cards.fmt import NOT_MEASURED, fmt_bytes, fmt_float

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _section(text: str, heading: str) -> str:
    start = text.index(heading)
    end = text.find("\n## ", start + len(heading))
    return text[start : end if end > 0 else None]


# --------------------------------------------------------------------------- the real artifact


def test_budget_section_shows_the_24gb_budget(reference_artifact):
    text = (reference_artifact / "README.md").read_text()
    budget = MemoryReport.read(reference_artifact).budget_24gb
    assert set(budget.budgets) == {"bf16", "int4"}
    section = _section(text, "### 24 GB budget")
    assert NOT_MEASURED not in section and "not determined" not in section and "{'" not in section
    assert "Target `reference:target`" in section and budget.gpu.name in section
    fits = re.search(r"^\| fits \| (yes|\*\*no\*\*) \| (yes|\*\*no\*\*) \|$", section, re.MULTILINE)
    assert fits, section
    for form, shown in zip(("bf16", "int4"), fits.groups(), strict=True):
        assert shown == ("yes" if budget.budgets[form].fits else "**no**")
    headroom = re.search(r"^\| headroom \| (.+) \| (.+) \|$", section, re.MULTILINE)
    assert headroom and all("GiB" in h for h in headroom.groups()), section
    assert headroom.groups() == tuple(fmt_bytes(budget.budgets[f].headroom_bytes) for f in ("bf16", "int4"))
    assert f"{budget.budgets['int4'].max_context:,} tokens" in section


def test_shipped_source_has_no_hub_link(reference_artifact):
    card = ModelCard.load(reference_artifact / "README.md")
    assert card.data.base_model is None and "base_model_relation" not in card.data.to_dict()
    assert "huggingface.co/reference" not in card.text and "reference/drafter" not in card.text
    assert "drafter `reference`, made with" in card.text
    assert "**Target model (pair it with this one only):** `reference:target`" in card.text
    assert "shipped with dflash-quant (`reference`), not a Hub repo" in card.text


def test_numbers_match_reports(reference_artifact):
    text = (reference_artifact / "README.md").read_text()
    parity, memory = Parity.read(reference_artifact), MemoryReport.read(reference_artifact)
    qr = QuantReport.read(reference_artifact)
    base, quant = parity.baseline, parity.quantized
    assert f"| this drafter | {base.tau:.3f} | {quant.tau:.3f} | {parity.tau_ratio * 100:.1f}% |" in text
    for k, (b, q) in enumerate(zip(base.per_position_acceptance, quant.per_position_acceptance, strict=True), start=1):
        assert f"| {k} | {fmt_float(b)} | {fmt_float(q)} |" in text
    assert (
        f"| weights in memory | {fmt_bytes(memory.baseline.total_bytes)} | {fmt_bytes(memory.weights.total_bytes)} |"
    ) in text
    assert f"{qr.quantized_bytes:,}" in text and f"{qr.original_bytes:,}" in text
    assert ("Parity check: **passed**" if parity.passed else "Parity check: **FAILED**") in text
    assert f"quantized Linear layers | {len(qr.layers)}" in text
    assert "![Per-position acceptance, bf16 vs quantized](acceptance.png)" in text
    # the producing command, its output path in portable form
    assert "dflash-quant gptq --output reference-int4" in text


def test_png_and_manifest(reference_artifact):
    png = (reference_artifact / "acceptance.png").read_bytes()
    assert png.startswith(PNG_MAGIC) and b"IEND" in png[-16:]
    assert verify_manifest(reference_artifact) == []
    assert {"README.md", "acceptance.png", "memory.json", "parity.json"} <= set(
        load_manifest(reference_artifact)["files"]
    )


def test_rewriting_the_card_keeps_it(reference_artifact, tmp_path):
    art = tmp_path / "copy"
    shutil.copytree(reference_artifact, art)
    before = (art / "README.md").read_text()
    write_card(art)  # `dflash-quant card` on a finished artifact: same reports, same card
    assert (art / "README.md").read_text() == before
    assert verify_manifest(art) == []
    assert Provenance.read(art).source_drafter.kind == "shipped"


def test_concurrent_card_runs_leave_one_whole_card_and_a_consistent_manifest(reference_artifact, tmp_path):
    """Three processes re-render one artifact's card (different --repo-id) at once, six times each."""
    art = tmp_path / "copy"
    shutil.copytree(reference_artifact, art)
    code = (
        "import sys\nfrom dflash_quant.model_cards.card import write_card\n"
        "for _ in range(6): write_card(sys.argv[1], repo_id=sys.argv[2])"
    )
    procs = [
        subprocess.Popen([sys.executable, "-c", code, str(art), f"org/run{k}"], stderr=subprocess.PIPE, text=True)
        for k in range(3)
    ]
    errors = [p.communicate(timeout=300)[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], errors
    text = (art / "README.md").read_text()
    winner = set(re.findall(r"org/run\d", text))
    assert len(winner) == 1
    alone = tmp_path / "alone"
    shutil.copytree(reference_artifact, alone)
    assert text == write_card(alone, repo_id=winner.pop()).read_text()  # that run's card, whole
    assert verify_manifest(art) == []  # README and chart recorded as they are on disk
    assert sorted(p.name for p in art.iterdir() if p.name.startswith(".")) == []  # no temp or lock files


def test_where_a_directory_cannot_be_locked_a_lock_file_serialises_updates(reference_artifact, tmp_path, monkeypatch):
    """NFS refuses flock on a directory (its flock needs a file open for writing): `card` then locks a hidden file."""
    import errno
    import fcntl
    import os
    import stat

    from dflash_quant.artifact import manifest

    real = fcntl.flock

    def nfs_like(fd, op):
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            raise OSError(errno.EBADF, "Bad file descriptor")
        return real(fd, op)

    monkeypatch.setattr(fcntl, "flock", nfs_like)
    art = tmp_path / "copy"
    shutil.copytree(reference_artifact, art)
    with manifest.updating(art):
        other = os.open(art / manifest.LOCK, os.O_WRONLY)
        try:
            with pytest.raises(BlockingIOError):  # held: another run waits
                real(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
        finally:
            os.close(other)
    before = (art / "README.md").read_text()
    write_card(art)
    assert (art / "README.md").read_text() == before and verify_manifest(art) == []


# --------------------------------------------------------------------------- hand-made edge cases


def test_hub_source_gets_base_model(tmp_path):
    art = make_artifact(tmp_path / "hub", big_bytes=0)
    card = ModelCard.load(art / "README.md")
    assert card.data.base_model == SOURCE_ID
    assert card.data.to_dict()["base_model_relation"] == "quantized"
    assert f"(https://huggingface.co/{SOURCE_ID})" in card.text and TARGET_ID in card.text
    assert card.data.license is None and "License:** not determined" in card.text
    assert "q/k/v are kept in bf16" in card.text
    section = _section(card.text, "### 24 GB budget")
    assert "| fits | yes | yes |" in section and "max context | 30,000 tokens | 32,768 tokens" in section


def test_missing_reports_say_not_measured(tmp_path):
    art = make_artifact(tmp_path / "bare", big_bytes=0, parity=False, memory=False, quant_report=False, card=False)
    write_card(art)
    text = (art / "README.md").read_text()
    assert not (art / "acceptance.png").exists()
    assert f"_{NOT_MEASURED}: `parity.json` is missing" in text
    assert f"_{NOT_MEASURED}: `memory.json` is missing" in text
    assert f"_{NOT_MEASURED}: `quant_report.json` is missing" in text
    assert "![" not in text and "tau bf16 |" not in text
    assert verify_manifest(art) == []


def test_memory_without_budget_and_malformed_report(tmp_path):
    art = make_artifact(tmp_path / "nb", big_bytes=0, card=False)
    (art / "manifest.json").unlink()  # as inside the export: reports may still change
    mem = MemoryReport.read(art)
    mem.budget_24gb = None
    mem.write(art)
    (art / "quant_report.json").write_text('{"layers": [{"name": 3}]}')
    write_card(art)
    text = (art / "README.md").read_text()
    assert "memory.json has no 24 GB budget" in text
    assert "`quant_report.json` is field 'layers[0].name' must be a string" in text


def test_stale_chart_removed_when_parity_goes(tmp_path):
    art = make_artifact(tmp_path / "a", big_bytes=0)
    assert (art / "acceptance.png").exists()
    (art / "parity.json").unlink()
    with pytest.raises(DFlashQuantError, match="parity.json is listed in the manifest but missing"):
        write_card(art)
    assert (art / "acceptance.png").exists()
    (art / "manifest.json").unlink()
    write_card(art)
    assert not (art / "acceptance.png").exists()


def test_failing_parity_shown(tmp_path):
    art = make_artifact(tmp_path / "f", big_bytes=0, parity_passed=False)
    text = (art / "README.md").read_text()
    assert "Parity check: **FAILED**" in text and "below 0.97" in text


def test_license_inherited_from_local_source(tmp_path):
    src = tmp_path / "src-drafter"
    src.mkdir()
    (src / "README.md").write_text("---\nlicense: mit\nlibrary_name: transformers\n---\n# drafter\n")
    art = make_artifact(tmp_path / "l", big_bytes=0, source_id=str(src), card=False)
    write_card(
        art,
        command=["dflash-quant", "gptq", "--token", "hf_secretsecretsecretsecret", "--output", str(art)],
        repo_id="me/d-int4",
    )
    card = ModelCard.load(art / "README.md")
    assert card.data.license == "mit"
    assert card.data.base_model is None  # a local path is not a Hub id
    assert "base_model` is not set" in card.text
    assert "hf_secretsecret" not in card.text and "--token '***'" in card.text
    assert f"--output {art.name}" in _section(card.text, "## How this was made")
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
