"""The artifact contract: typed reports round-trip, malformed ones fail in one line, docs/artifact.md is
generated from the classes, sources are recorded without machine paths."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest

from dflash_quant.artifact import docgen
from dflash_quant.artifact.files import portable_path
from dflash_quant.artifact.reports import (
    REPORT_FILES,
    Check,
    MemoryReport,
    Parity,
    Provenance,
)
from dflash_quant.artifact.sources import portable_command, source_ref
from dflash_quant.errors import DFlashQuantError
from dflash_quant.io.weights import read_header
from dflash_quant.loading import Source, resolve
from dflash_quant.reference import PACKAGE_DIR, pair_dir


def test_doc_is_generated_from_the_classes():
    text = docgen.DOC.read_text(encoding="utf-8")
    assert docgen.updated(text) == text, "run: python -m dflash_quant.artifact.docgen"
    for cls in REPORT_FILES:
        assert f"### `{cls.FILE}`: `{cls.__name__}`" in text
        for name, _, _ in cls.fields():
            assert f"| `{name}` |" in text


def test_real_reports_round_trip_unchanged(reference_artifact):
    for cls in REPORT_FILES:
        raw = json.loads((reference_artifact / cls.FILE).read_text())
        assert cls.read(reference_artifact).to_dict() == raw, cls.FILE


def test_unknown_keys_survive_a_rewrite(reference_artifact, tmp_path):
    shutil.copy(reference_artifact / "parity.json", tmp_path / "parity.json")
    raw = json.loads((tmp_path / "parity.json").read_text())
    raw["quantized"].update(future_field=12, another={"x": 340})
    raw["bf16_margin"] = {"min": 0.01}
    (tmp_path / "parity.json").write_text(json.dumps(raw))
    parity = Parity.read(tmp_path)
    assert parity.quantized.extra == {"future_field": 12, "another": {"x": 340}}
    parity.write(tmp_path)
    assert json.loads((tmp_path / "parity.json").read_text()) == raw
    assert isinstance(parity.baseline, Check) and parity.baseline.tau == raw["baseline"]["tau"]


@pytest.mark.parametrize(
    "content, why",
    [
        ("{not json", "is not valid JSON"),
        ('{"budget_24gb": {"gpu": "RTX 4090", "fits": true}}', "field 'budget_24gb.gpu' must be an object"),
        ('{"weights": {"total_bytes": "1 GB"}}', "field 'weights.total_bytes' must be an integer"),
        ("[1, 2]", "must be an object"),
    ],
)
def test_malformed_report_is_one_line_naming_file_and_fix(tmp_path, content, why):
    (tmp_path / "memory.json").write_text(content)
    with pytest.raises(DFlashQuantError) as exc:
        MemoryReport.read(tmp_path)
    message = str(exc.value)
    assert "\n" not in message and why in message
    assert str(tmp_path / "memory.json") in message and "dflash-quant memory" in message
    assert MemoryReport.read(tmp_path / "absent", optional=True) is None


def _forbidden() -> list[str]:
    names = [tempfile.gettempdir() + "/", os.getcwd(), str(Path.home()), ".tmp-", str(PACKAGE_DIR)]
    return [n for n in names if n not in ("/", "")]


def test_no_machine_paths_in_any_file(reference_artifact):
    forbidden = _forbidden() + [str(reference_artifact.parent)]
    checked = 0
    for path in sorted(reference_artifact.rglob("*")):
        if not path.is_file():
            continue
        if path.suffix == ".safetensors":
            text = json.dumps(read_header(path).get("__metadata__", {}))
        elif path.suffix == ".png":
            text = path.read_bytes().decode("latin-1")  # PNG text chunks
        else:
            text = path.read_text(encoding="utf-8")
        for bad in forbidden:
            assert bad not in text, f"{path.name} contains {bad!r}"
        checked += 1
    assert checked >= 10
    prov = Provenance.read(reference_artifact)
    assert (prov.source_drafter.id, prov.source_drafter.kind) == ("reference", "shipped")
    assert (prov.target.id, prov.target.kind) == ("reference:target", "shipped")
    assert len(prov.source_drafter.sha256) == 64 and len(prov.target.sha256) == 64
    assert MemoryReport.read(reference_artifact).artifact == "reference-int4"


def test_shipped_names_old_and_new_spellings():
    for spec, want in (
        ("reference", "reference"),
        ("reference/drafter", "reference"),
        ("reference:drafter", "reference"),
        ("reference/target", "reference:target"),
        ("reference:target", "reference:target"),
    ):
        src = resolve(spec)
        assert (src.id, src.kind) == (want, "shipped"), spec
        assert source_ref(src).to_dict() == {"id": want, "kind": "shipped", "revision": None, "sha256": None}
    # a path into the installed package is shipped too, whatever it is called
    src = resolve(str(pair_dir() / "target"))
    assert src.kind == "shipped" and source_ref(src).id == "reference:target"


def test_local_and_hub_cache_sources(tmp_path, monkeypatch):
    local = tmp_path / "work" / "models" / "my-drafter"
    shutil.copytree(pair_dir() / "drafter", local)
    monkeypatch.chdir(tmp_path / "work")
    src = resolve(str(local))
    assert src.kind == "local"
    ref = source_ref(src, "ab" * 32)
    assert (ref.id, ref.kind, ref.path, ref.sha256) == ("models/my-drafter", "local", "models/my-drafter", "ab" * 32)
    monkeypatch.chdir(tmp_path)
    assert source_ref(src).id == "work/models/my-drafter"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert source_ref(src).id == "my-drafter"  # outside the working directory: its name only
    commit = "0123456789abcdef0123456789abcdef01234567"
    snap = tmp_path / "hub" / "models--org--d-b16" / "snapshots" / commit
    ref = source_ref(Source(id=str(snap), path=snap))
    assert (ref.id, ref.kind, ref.revision) == ("org/d-b16", "hub", commit)
    assert source_ref(Source(id="org/d-b16", path=snap, revision="main", kind="hub")).revision == commit


def test_portable_command_and_paths(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "out").mkdir()
    argv = [
        "dflash-quant",
        "gptq",
        "--output",
        str(tmp_path / "out" / "x"),
        f"--calib-cache={Path.home()}/cache",
        "--drafter",
        "~/models/d",
        "--bits",
        "4",
        "org/name",
        "rel/dir",
    ]
    assert portable_command(argv) == [
        "dflash-quant",
        "gptq",
        "--output",
        "out/x",
        "--calib-cache=cache",
        "--drafter",
        "d",
        "--bits",
        "4",
        "org/name",
        "rel/dir",
    ]
    assert portable_path(tmp_path) == "."
    assert portable_path("/") == "."
