"""Every artifact a command writes is accepted by every later command: the format x command matrix.

Formats: the GPTQ v1 artifact of `gptq` on the shipped reference pair (g32), its `export`s to compressed-tensors,
GGUF and MLX, a per-Linear mixed-precision GPTQ artifact (`gptq --max-bytes`) with its compressed-tensors export,
and the k-quant GGUF that `gptq --gguf-type` writes directly. Commands, each a real CLI subprocess: `verify`,
`verify --compare` (the bf16 drafter), `memory`, `card`, `push --dry-run` and a real `push` to the loopback Hub.

The g32 grid is exact in every format (same codes, same fp16 scales), so each export must give the source's tau
and per-position acceptance on the same prompts, to the last digit; memory and card must state the sizes of the
format's own files, counted here by independent readers (the safetensors header length, gguf-py's reader).
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from hub_fixtures import FAKE_TOKEN
from hub_server import FakeHub

from dflash_quant.artifact.manifest import verify_manifest
from dflash_quant.model_cards.fmt import fmt_bytes
from dflash_quant.reference import pair_dir

gguf = pytest.importorskip("gguf")
# CLI subprocesses on the reference pair; the artifacts are built once for the module (`make test` runs a
# module's tests on one worker: --dist loadfile)
pytestmark = [pytest.mark.slow]

CLI = [sys.executable, "-m", "dflash_quant.cli.app"]
BF16 = str(pair_dir("reference") / "drafter")
CHECK = ["--num-prompts", "4", "--max-new-tokens", "24", "--device", "cpu", "--no-check-cache", "--json"]
GPTQ_RUN = ["--num-prompts", "8", "--max-new-tokens", "32", "--eval-num-prompts", "8", "--eval-max-new-tokens", "32"]
GPTQ_RUN += ["--group-size", "32", "--device", "cpu", "--no-check-cache"]


def cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *map(str, args)], capture_output=True, text=True, timeout=600, env=env)


def ok(res: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert res.returncode == 0, res.stderr[-3000:]
    assert "Traceback" not in res.stderr, res.stderr[-3000:]
    return res


@pytest.fixture(scope="module")
def arts(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("matrix")
    out = {"gptq": root / "gptq", "mixed": root / "mixed", "kquant-gguf": root / "kquant"}
    ok(cli("gptq", "--output", out["gptq"], *GPTQ_RUN))
    ok(cli("gptq", "--output", out["mixed"], *GPTQ_RUN, "--max-bytes", "1000000", "--mix-dev-prompts", "2"))
    ok(cli("gptq", "--output", out["kquant-gguf"], *GPTQ_RUN, "--format", "gguf", "--gguf-type", "Q4_K"))
    for fmt in ("compressed-tensors", "gguf", "mlx"):
        out[fmt] = root / fmt
        ok(cli("export", out["gptq"], "--format", fmt, "--output", out[fmt]))
    out["mixed-compressed-tensors"] = root / "mixed-ct"
    ok(cli("export", out["mixed"], "--format", "compressed-tensors", "--output", out["mixed-compressed-tensors"]))
    return out


FORMATS = ["gptq", "compressed-tensors", "gguf", "mlx", "mixed", "mixed-compressed-tensors", "kquant-gguf"]
SOURCE = {"compressed-tensors": "gptq", "gguf": "gptq", "mlx": "gptq", "mixed-compressed-tensors": "mixed"}


def copy(arts: dict[str, Path], name: str, tmp_path: Path) -> Path:
    """A private copy: commands that write (memory, card) must not change what other tests read."""
    dst = tmp_path / name
    shutil.copytree(arts[name], dst)
    return dst


def stored_bytes(root: Path) -> int:
    """Bytes of the weight tensors in the format's own files, read without dflash-quant."""
    ggufs = [f for f in root.glob("*.gguf") if not f.name.endswith(".imatrix.gguf")]
    if ggufs:
        return sum(int(t.n_bytes) for f in ggufs for t in gguf.GGUFReader(f).tensors)
    total = 0
    for f in root.glob("*.safetensors"):
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
        total += f.stat().st_size - 8 - n
    return total


def summary(res: subprocess.CompletedProcess) -> dict:
    return json.loads(res.stdout)["summary"]


@pytest.fixture(scope="module")
def verified(arts) -> dict[str, dict]:
    """`verify` of every artifact on the same prompts (each resolves its target from provenance.json)."""
    return {name: summary(ok(cli("verify", arts[name], *CHECK))) for name in FORMATS}


@pytest.mark.parametrize("name", FORMATS)
def test_verify_runs_lossless(verified, name):
    s = verified[name]
    assert s["lossless"] is True and s["tau"] >= 1
    assert len(s["per_position_acceptance"]) >= 1


@pytest.mark.parametrize("name", sorted(SOURCE))
def test_verify_gives_the_source_tau(verified, name):
    got, want = verified[name], verified[SOURCE[name]]
    assert got["tau"] == want["tau"]
    assert got["per_position_acceptance"] == want["per_position_acceptance"]
    assert [p["new_tokens"] for p in got["per_prompt"]] == [p["new_tokens"] for p in want["per_prompt"]]


@pytest.mark.parametrize("name", FORMATS)
def test_verify_compare_against_bf16(arts, verified, name):
    # the gate is not what is tested here (4 prompts are noisy): a wide tolerance keeps the exit code about
    # whether the artifact is accepted and checked
    report = json.loads(ok(cli("verify", arts[name], "--compare", BF16, "--tolerance", "0.5", *CHECK)).stdout)
    assert report["summary"]["tau"] == verified[name]["tau"]
    assert report["parity"]["tau_ratio"] == pytest.approx(report["summary"]["tau"] / report["baseline"]["tau"], 1e-3)


@pytest.mark.parametrize("name", FORMATS)
def test_memory_states_the_format_own_sizes(arts, name, tmp_path):
    art = copy(arts, name, tmp_path)
    rep = json.loads(ok(cli("memory", art, "--baseline", BF16, "--json")).stdout)
    want = stored_bytes(art)
    assert rep["weights"]["total_bytes"] == want
    assert rep["baseline"]["ratio"] == round(want / rep["baseline"]["total_bytes"], 4)
    assert rep["weights"]["quantized_linears"] >= 1
    # every format of the same drafter holds the same logical parameters
    source = json.loads((arts["gptq"] / "memory.json").read_text())
    assert rep["weights"]["params"] == source["weights"]["params"]
    written = json.loads((art / "memory.json").read_text())
    assert written["weights"]["total_bytes"] == want
    assert verify_manifest(art) == []  # memory updated its own manifest entry only


@pytest.mark.parametrize("name", FORMATS)
def test_export_and_gptq_record_the_format_own_sizes(arts, name):
    """Straight out of `gptq` / `export` (no `memory` run), memory.json and quant_report.json are this format's."""
    art = arts[name]
    want = stored_bytes(art)
    assert json.loads((art / "memory.json").read_text())["weights"]["total_bytes"] == want
    assert json.loads((art / "quant_report.json").read_text())["drafter_bytes_quantized"] == want
    assert verify_manifest(art) == []


@pytest.mark.parametrize("name", FORMATS)
def test_card_shows_the_format_own_sizes(arts, name, tmp_path):
    art = copy(arts, name, tmp_path)
    (art / "README.md").unlink()
    ok(cli("card", art))
    card = (art / "README.md").read_text()
    assert fmt_bytes(stored_bytes(art)) in card
    assert verify_manifest(art) == []


@pytest.mark.parametrize("name", FORMATS)
def test_push_dry_run_and_push_to_loopback_hub(arts, name, tmp_path):
    art = arts[name]
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env.update(HF_HOME=str(tmp_path / "home"), HF_HUB_OFFLINE="0", HF_TOKEN=FAKE_TOKEN, HF_HUB_DISABLE_XET="1")
    plan = json.loads(ok(cli("push", art, "--repo-id", "org/drafter", "--dry-run", "--json", env=env)).stdout)
    listed = {f["path"] for f in plan["plan"]["files"]}
    weights = {f.name for f in art.iterdir() if f.suffix in (".safetensors", ".gguf")}
    assert weights and weights <= listed
    with FakeHub(FAKE_TOKEN, upload_mode="auto") as hub:
        ok(cli("push", art, "--repo-id", "org/drafter", "--endpoint", hub.url, env=env))
        files = hub.files("org/drafter", "main")
    manifest = json.loads((art / "manifest.json").read_text())
    assert set(files) == set(manifest["files"]) | {"manifest.json"}
    assert all(data == (art / path).read_bytes() for path, data in files.items())
