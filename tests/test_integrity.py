"""Artifact integrity (issue #13): only the export records weight hashes; card/memory verify first and
update only their own entries; push checks everything before its first request and uploads only what
the manifest vouches for."""

from __future__ import annotations

import hashlib
import json
import os

import pytest
from hub_fixtures import FAKE_TOKEN, make_artifact
from hub_server import FakeHub

import dflash_quant.hub.push as push_mod
from dflash_quant.artifact.manifest import (
    check_artifact_files,
    name_problem,
    record_files,
    require_intact,
    verify_manifest,
    write_manifest,
)
from dflash_quant.artifact.reports import MemoryReport
from dflash_quant.errors import DFlashQuantError
from dflash_quant.hub.push import check_artifact, plan_push, push_artifact
from dflash_quant.memory.report import write_memory_json
from dflash_quant.model_cards.card import write_card

REPO = "dflash-org/qwen3-8b-dflash-int4"


@pytest.fixture(autouse=True)
def online(monkeypatch):
    import huggingface_hub.constants as constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(push_mod, "RETRY_WAIT_S", 0.01)


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    return make_artifact(tmp_path_factory.mktemp("integrity") / "art", big_bytes=0)


@pytest.fixture
def art(pristine, tmp_path):
    import shutil

    dest = tmp_path / "art"
    shutil.copytree(pristine, dest)
    return dest


def _manifest(art):
    return json.loads((art / "manifest.json").read_text())["files"]


def _flip_byte(path, offset=-100):
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def _add_entry(art, name, content):
    """A manifest entry with a correct hash for `content` (what a hostile or broken manifest could say)."""
    manifest = json.loads((art / "manifest.json").read_text())
    manifest["files"][name] = {"sha256": hashlib.sha256(content).hexdigest(), "bytes": len(content)}
    (art / "manifest.json").write_text(json.dumps(manifest))


# --------------------------------------------------------------------------- manifest rules


@pytest.mark.parametrize(
    "name,why",
    [
        ("../outside.txt", "'..' part"),
        ("sub/../../x", "'..' part"),
        ("/etc/passwd", "absolute"),
        ("C:/x", "absolute"),
        ("a\\b", "backslash"),
        ("a//b", "empty"),
        ("./a", "'.'"),
        ("", "not a file name"),
        ("manifest.json", "manifest itself"),
    ],
)
def test_bad_entry_names(name, why):
    assert why in name_problem(name)


def test_plain_names_pass():
    assert name_problem("model.safetensors") is None and name_problem("sub/dir/file.json") is None


def test_clean_artifact_verifies(art):
    problems, verified = check_artifact_files(art)
    assert problems == []
    assert {f.name for f in verified} == set(_manifest(art))


@pytest.mark.parametrize(
    "case,expect",
    [
        ("dotdot", "'..' part"),
        ("absolute", "absolute path"),
        ("unlisted", "extra.txt is not in the manifest"),
        ("symlink_listed", "quant_report.json is a symlink"),
        ("symlink_dir", "linked is a symlink"),
        ("directory_entry", "sub is not a regular file"),
        ("bad_sha", "no valid sha256"),
        ("manifest_not_json", "manifest.json is not valid JSON"),
        ("manifest_symlink", "manifest.json is not a regular file"),
        ("fifo", "pipe is not a regular file"),
    ],
)
def test_hostile_trees_are_problems(art, tmp_path, case, expect):
    outside = tmp_path / "outside.txt"
    outside.write_bytes(b"secret outside the artifact\n")
    if case == "dotdot":
        _add_entry(art, "../outside.txt", outside.read_bytes())
    elif case == "absolute":
        _add_entry(art, str(outside), outside.read_bytes())
    elif case == "unlisted":
        (art / "extra.txt").write_text("x")
    elif case == "symlink_listed":  # same bytes as recorded, still refused: push would follow the link
        real = tmp_path / "qr.json"
        real.write_bytes((art / "quant_report.json").read_bytes())
        (art / "quant_report.json").unlink()
        (art / "quant_report.json").symlink_to(real)
    elif case == "symlink_dir":
        (art / "linked").symlink_to(tmp_path)
    elif case == "directory_entry":
        (art / "sub").mkdir()
        _add_entry(art, "sub", b"")
    elif case == "bad_sha":
        manifest = json.loads((art / "manifest.json").read_text())
        manifest["files"]["config.json"]["sha256"] = "nothex"
        (art / "manifest.json").write_text(json.dumps(manifest))
    elif case == "manifest_not_json":
        (art / "manifest.json").write_text("{not json")
    elif case == "manifest_symlink":
        real = tmp_path / "m.json"
        real.write_bytes((art / "manifest.json").read_bytes())
        (art / "manifest.json").unlink()
        (art / "manifest.json").symlink_to(real)
    elif case == "fifo":
        os.mkfifo(art / "pipe")
    problems = verify_manifest(art)
    assert any(expect in p for p in problems), problems


def test_hidden_files_ignored(art):
    (art / ".README.md.tmp").write_text("left by a crash")
    assert verify_manifest(art) == []


def test_export_refuses_symlinks(tmp_path):
    (tmp_path / "a.txt").write_text("a")
    (tmp_path / "b.txt").symlink_to(tmp_path / "a.txt")
    with pytest.raises(DFlashQuantError, match="b.txt is a symlink"):
        write_manifest(tmp_path)


# --------------------------------------------------------------------------- card / memory


def test_card_refuses_flipped_weights_and_keeps_the_hash(art):
    before_manifest = (art / "manifest.json").read_bytes()
    before_readme = (art / "README.md").read_bytes()
    _flip_byte(art / "model.safetensors")
    with pytest.raises(DFlashQuantError) as info:
        write_card(art, repo_id="me/other-name")
    msg = str(info.value)
    assert "model.safetensors does not match its sha256" in msg and "dflash-quant gptq" in msg
    assert "dflash-quant card" not in msg and "\n" not in msg
    assert (art / "manifest.json").read_bytes() == before_manifest
    assert (art / "README.md").read_bytes() == before_readme
    with pytest.raises(DFlashQuantError, match="model.safetensors does not match"):
        check_artifact(art, force=True)


def test_memory_refuses_flipped_weights(art):
    before = (art / "manifest.json").read_bytes()
    memory = (art / "memory.json").read_bytes()
    _flip_byte(art / "model.safetensors")
    with pytest.raises(DFlashQuantError, match="memory: .*model.safetensors does not match"):
        write_memory_json(MemoryReport(artifact="x"), art)
    assert (art / "manifest.json").read_bytes() == before and (art / "memory.json").read_bytes() == memory


def test_card_updates_only_its_own_entries(art):
    before = _manifest(art)
    old_readme = (art / "README.md").read_bytes()
    write_card(art, repo_id="me/renamed-int4")
    after = _manifest(art)
    assert (art / "README.md").read_bytes() != old_readme
    assert after["README.md"]["sha256"] == hashlib.sha256((art / "README.md").read_bytes()).hexdigest()
    for name in set(before) - {"README.md", "acceptance.png"}:
        assert after[name] == before[name], name
    assert verify_manifest(art) == []


def test_memory_updates_only_its_own_entry(art):
    before = _manifest(art)
    write_memory_json(MemoryReport.from_dict({"artifact": art.name, "weights": {"total_bytes": 1}}), art)
    after = _manifest(art)
    assert after["memory.json"] != before["memory.json"]
    assert {k: v for k, v in after.items() if k != "memory.json"} == {
        k: v for k, v in before.items() if k != "memory.json"
    }
    assert verify_manifest(art) == []


def test_record_files_drops_a_removed_own_file(art):
    (art / "acceptance.png").unlink()
    require_intact(art, stage="card", skip=("README.md", "acceptance.png"))
    record_files(art, ("acceptance.png",))
    assert "acceptance.png" not in _manifest(art) and verify_manifest(art) == []


# --------------------------------------------------------------------------- push: nothing sent


def _hostile(art, tmp_path, case):
    outside = tmp_path / "outside.txt"
    outside.write_bytes(b"private notes that must never reach the Hub\n")
    if case == "symlink":
        (art / "notes.txt").symlink_to(outside)
        _add_entry(art, "notes.txt", outside.read_bytes())
        return "notes.txt is a symlink"
    if case == "tampered":
        _flip_byte(art / "model.safetensors")
        return "model.safetensors does not match its sha256"
    if case == "dotdot":
        _add_entry(art, "../outside.txt", outside.read_bytes())
        return "'..' part"
    if case == "absolute":
        _add_entry(art, str(outside), outside.read_bytes())
        return "absolute path"
    if case == "unlisted":
        (art / "notes.txt").write_text("not vouched for")
        return "notes.txt is not in the manifest"
    if case == "bad_provenance":  # hash-consistent, so only the shape check catches it
        (art / "provenance.json").write_text(json.dumps({"source_drafter": "z-lab/x", "command": "gptq"}))
        write_manifest(art)
        return "provenance.json field 'command' must be a list"
    raise AssertionError(case)


@pytest.mark.parametrize("case", ["symlink", "tampered", "dotdot", "absolute", "unlisted", "bad_provenance"])
@pytest.mark.parametrize("force", [False, True])
def test_push_refuses_before_any_request(art, tmp_path, case, force):
    expect = _hostile(art, tmp_path, case)
    with FakeHub(FAKE_TOKEN, upload_mode="regular") as hub:
        with pytest.raises(DFlashQuantError) as info:
            push_artifact(art, REPO, endpoint=hub.url, token=FAKE_TOKEN, force=force)
        assert hub.requests() == []  # not even create_repo
    msg = str(info.value)
    assert expect in msg and "\n" not in msg and "dflash-quant gptq" in msg, msg
    assert "--force to push" not in msg


def test_plan_lists_only_verified_files(art, tmp_path):
    _hostile(art, tmp_path, "absolute")
    (art / "extra.txt").write_text("x")
    names = [f.path for f in plan_push(art, REPO, endpoint="http://127.0.0.1:9").files]
    assert all(not n.startswith("/") and ".." not in n and n != "extra.txt" for n in names)
    assert "model.safetensors" in names and names[-1] == "manifest.json"


def test_push_uploads_exactly_the_manifest(art):
    (art / ".hidden-scratch").write_text("never uploaded")
    with FakeHub(FAKE_TOKEN, upload_mode="regular") as hub:
        push_artifact(art, REPO, endpoint=hub.url, token=FAKE_TOKEN)
        files = hub.files(REPO)
    assert set(files) == set(_manifest(art)) | {"manifest.json"}
    for name, data in files.items():
        assert data == (art / name).read_bytes(), name


def test_push_refuses_a_file_swapped_after_the_check(art, monkeypatch):
    """A file replaced between the hash check and the read of its bytes is refused before any request."""
    real = push_mod._checked

    def check_then_swap(root, force):
        result = real(root, force)
        tmp = art / "config.json.new"
        tmp.write_bytes((art / "config.json").read_bytes().replace(b"256", b"512"))
        tmp.replace(art / "config.json")
        return result

    monkeypatch.setattr(push_mod, "_checked", check_then_swap)
    with FakeHub(FAKE_TOKEN, upload_mode="regular") as hub:
        with pytest.raises(DFlashQuantError, match="config.json changed while pushing"):
            push_artifact(art, REPO, endpoint=hub.url, token=FAKE_TOKEN)
        assert hub.requests() == []


def test_large_file_uploaded_from_the_checked_descriptor(art, monkeypatch):
    """Above IN_MEMORY_LIMIT the upload reads the checked inode; huggingface_hub's hash must match the manifest."""
    monkeypatch.setattr(push_mod, "IN_MEMORY_LIMIT", 1024)
    with FakeHub(FAKE_TOKEN, upload_mode="regular") as hub:
        push_artifact(art, REPO, endpoint=hub.url, token=FAKE_TOKEN)
        assert hub.files(REPO)["model.safetensors"] == (art / "model.safetensors").read_bytes()


def test_force_still_overrides_a_failed_parity_gate(tmp_path):
    art = make_artifact(tmp_path / "f", big_bytes=0, parity_passed=False)
    with pytest.raises(DFlashQuantError, match="parity check did not pass.*--force"):
        check_artifact(art)
    assert any("--force" in w and "parity" in w for w in check_artifact(art, force=True))


def test_saved_weights_are_byte_identical_across_runs(tmp_path):
    """safetensors writes its metadata in hash order; the same tensors must still give the same file (sha256)."""
    import struct

    import torch

    from dflash_quant.io.weights import save_safetensors

    meta = {"quantized_by": "dflash-quant 0.1.0", "format": "pt", "note": "drafter für 24 GB"}  # non-ASCII too
    files = []
    for i in range(6):
        path = tmp_path / f"w{i}.safetensors"
        save_safetensors({"b.qweight": torch.arange(8, dtype=torch.int32), "a": torch.ones(2, 3)}, path, dict(meta))
        files.append(path.read_bytes())
    assert len(set(files)) == 1
    (n,) = struct.unpack("<Q", files[0][:8])
    header = json.loads(files[0][8 : 8 + n])
    assert list(header["__metadata__"]) == sorted(meta) and header["__metadata__"] == meta
