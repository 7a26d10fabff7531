"""GPTQ on llama.cpp's k-quant/IQ4_NL grids, the drafter imatrix, and the llama.cpp pairing check.

gguf-py (`gguf.quants.dequantize`, `GGUFReader`) is the independent reader: every tensor we write must decode
there to exactly our own weights. Tests that need a llama.cpp build are marked `llamacpp` and skipped when
`llama-quantize` is absent (LLAMA_CPP_BIN, default /work/llama-build/bin).
"""

import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from dflash_quant.calibration.capture import CalibrationStats, input_group  # noqa: E402
from dflash_quant.calibration.hessian import HessianAccumulator  # noqa: E402
from dflash_quant.errors import UsageError  # noqa: E402
from dflash_quant.export.gguf import encode_kquant, pairing_problem  # noqa: E402
from dflash_quant.export.imatrix import read_imatrix, write_for_stats  # noqa: E402
from dflash_quant.io.gguf import read_gguf  # noqa: E402
from dflash_quant.io.gguf_names import gguf_name  # noqa: E402
from dflash_quant.quantize.kmix import MIXES, tensor_types  # noqa: E402
from dflash_quant.quantize.kquant import GRIDS, gptq_kquant, relative_error, rtn_kquant  # noqa: E402

PAIR = Path(__file__).resolve().parents[1] / "dflash_quant" / "reference" / "pair"
LLAMA_BIN = Path(os.environ.get("LLAMA_CPP_BIN", "/work/llama-build/bin"))


def _problem(rows=32, cols=512, seed=0):
    """A weight and a Hessian from correlated inputs with uneven column scales (what GPTQ exploits)."""
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(rows, cols, generator=g) * 0.05
    W[:, :7] *= 8  # outliers stretch some sub-block scales
    mix = torch.randn(cols, cols, generator=g) / cols**0.5 + torch.eye(cols)
    X = (torch.randn(1024, cols, generator=g) @ mix) * torch.linspace(0.2, 3.0, cols)
    return W, X.T @ X / X.shape[0]


@pytest.mark.parametrize("kind", sorted(GRIDS))
def test_grid_tensors_decode_through_gguf_py_exactly(kind):
    W, H = _problem()
    grid = GRIDS[kind]
    for qw in (gptq_kquant(W, H, grid), gptq_kquant(W, H, grid, scale_search=2), rtn_kquant(W, grid, H.diagonal())):
        data = encode_kquant(qw)
        assert data.shape == (W.shape[0], W.shape[1] // grid.block * grid.bytes_per_block)
        theirs = gguf.quants.dequantize(data, gguf.GGMLQuantizationType[kind]).astype(np.float32)
        ours = qw.dequantize().numpy()
        assert np.array_equal(theirs.view(np.uint32), ours.view(np.uint32)), kind  # bit for bit
        # stored fields stay inside what the type can hold
        assert int(qw.sc.min()) >= grid.scale_lo and int(qw.sc.max()) <= max(grid.scale_max, 0)
        assert int(qw.codes.max()) < grid.levels
        assert torch.equal(qw.d, qw.d.half().float())


@pytest.mark.parametrize("kind", sorted(GRIDS))
def test_gptq_on_grid_beats_round_to_nearest(kind):
    W, H = _problem(seed=1)
    grid = GRIDS[kind]
    gptq = relative_error(W, gptq_kquant(W, H, grid).dequantize(), H)
    rtn = relative_error(W, rtn_kquant(W, grid, H.diagonal()).dequantize(), H)
    assert gptq < 0.97 * rtn, (kind, gptq, rtn)


@pytest.mark.parametrize("kind", sorted(k for k in GRIDS if k != "IQ4_NL"))
def test_in_loop_scale_search_lowers_the_output_error(kind):
    """The sub-block scales chosen by the GPTQ loss beat the diagonal-weighted fit on the full-Hessian error,
    and a wider search keeps the candidates of a narrower one (the radius-0 choice is always among them)."""
    W, H = _problem(seed=2)
    grid = GRIDS[kind]
    err = [relative_error(W, gptq_kquant(W, H, grid, scale_search=r).dequantize(), H) for r in (0, 1, 3)]
    assert err[1] < 0.995 * err[0] and err[2] < err[0], (kind, err)


def test_grid_refuses_widths_it_cannot_hold():
    W, H = _problem(cols=96)
    with pytest.raises(UsageError, match="multiple of 256"):
        gptq_kquant(W, H, GRIDS["Q4_K"])


def _stats(names, kv_hessian="block+context", seed=0):
    """Calibration statistics for the reference drafter's Linears from random inputs, with the inputs kept."""
    from dflash_quant.loading.drafter import load_drafter

    model = load_drafter(str(PAIR / "drafter")).model
    g = torch.Generator().manual_seed(seed)
    hessians, inputs = {}, {}
    for name in names:
        group = input_group(name, kv_hessian)
        if group in hessians:
            continue
        width = model.get_submodule(name).in_features
        x = torch.randn(40 + 3 * len(hessians), width, generator=g) * torch.linspace(0.1, 2.0, width)
        acc = HessianAccumulator(width, name=group)
        acc.add(x[:20])
        acc.add(x[20:])
        hessians[group], inputs[group] = acc, x
    return CalibrationStats(hessians=hessians, kv_hessian=kv_hessian, prompts=4), inputs, model


def test_imatrix_reads_back_as_sum_of_squares_under_drafter_tensor_names(tmp_path):
    from dflash_quant.loading.drafter import load_drafter

    names = load_drafter(str(PAIR / "drafter")).model.linear_names()
    stats, inputs, _ = _stats(names)
    path = write_for_stats(tmp_path / "d.imatrix.gguf", stats, names, "reference:calib")
    reader = gguf.GGUFReader(str(path))
    assert reader.fields["general.type"].contents() == "imatrix"
    assert reader.fields["imatrix.datasets"].contents() == ["reference:calib"]
    assert reader.fields["imatrix.chunk_count"].contents() == 4
    assert reader.fields["imatrix.chunk_size"].contents() >= 1
    tensors = {t.name: t for t in reader.tensors}
    assert all(t.tensor_type == gguf.GGMLQuantizationType.F32 for t in reader.tensors)
    expected = {gguf_name(f"{n}.weight") for n in names}
    assert {k.rsplit(".", 1)[0] for k in tensors} == expected
    for name in names:
        x = inputs[input_group(name, stats.kv_hessian)]
        key = gguf_name(f"{name}.weight")
        np.testing.assert_allclose(
            np.array(tensors[f"{key}.in_sum2"].data).reshape(-1), (x.double() ** 2).sum(0).numpy(), rtol=2e-5
        )
        assert np.array(tensors[f"{key}.counts"].data).reshape(-1).tolist() == [float(x.shape[0])]
    mean = read_imatrix(path)
    assert set(mean) == expected and all(
        v.shape == (inputs[input_group(n, "block+context")].shape[1],)
        for n, v in zip(names, (mean[gguf_name(f"{n}.weight")] for n in names), strict=False)
    )


def test_pairing_check_refuses_a_tap_on_the_last_layer(tmp_path):
    import json

    config = json.loads((PAIR / "drafter" / "config.json").read_text())
    assert pairing_problem(config, PAIR / "target") is None  # taps [0, 2, 4] of 6: llama.cpp reads inputs 1, 3, 5
    config["dflash_config"]["target_layer_ids"] = [0, 2, 5]
    problem = pairing_problem(config, PAIR / "target")
    assert "last of 6" in problem and "llama-server would abort" in problem and "\n" not in problem


def test_gptq_gguf_type_writes_llama_cpp_grid_read_back_exactly(tmp_path):
    from dflash_quant.loading.drafter import load_drafter
    from dflash_quant.pipeline.job import GptqJob
    from dflash_quant.pipeline.run import run_gptq
    from dflash_quant.quantize.kquant import quantize_drafter_kquant
    from dflash_quant.quantize.settings import QuantSettings

    out = tmp_path / "q3k"
    run_gptq(
        GptqJob(
            output=out,
            quant=QuantSettings(method="rtn"),
            verify=False,
            write_card=False,
            format="gguf",
            gguf_type="Q3_K",
            device="cpu",
        )
    )
    reader = gguf.GGUFReader(str(out / "drafter-Q3_K.gguf"))
    kinds = {t.name: t.tensor_type.name for t in reader.tensors}
    assert (
        kinds["blk.0.attn_q.weight"] == "Q3_K"
        and kinds["fc.weight"] == "Q3_K"
        and kinds["blk.0.attn_norm.weight"] == "F32"
    )
    # the same quantization in memory equals what gguf-py decodes from the file
    drafter = load_drafter(str(PAIR / "drafter"), device="cpu", dtype=torch.float32)
    outcome = quantize_drafter_kquant(drafter.model, None, QuantSettings(method="rtn"), "Q3_K")
    stored = read_gguf(out)
    for name, qw in outcome.weights.items():
        assert torch.equal(stored[f"{name}.weight"], qw.dequantize()), name


def _linears(n_layer):
    roles = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
    return ["fc.weight"] + [f"blk.{i}.{r}.weight" for i in range(n_layer) for r in roles]


def test_mixes_assign_types_per_tensor_as_llama_quantize():
    """Hand-derived from llama-quant.cpp's rules: the reference drafter (3 layers, 4 heads / 2 kv heads) and a
    Qwen3-8B-DFlash-like drafter (5 layers, gqa 4)."""
    ref = {m: tensor_types(m, _linears(3), 3, 4, 2) for m in MIXES}
    # Q4_K_M: use_more_bits(i, 3) holds only for layer 2 (i >= 7*3//8 = 2)
    assert {t for t, k in ref["Q4_K_M"].items() if k != "Q4_K"} == {"blk.2.attn_v.weight", "blk.2.ffn_down.weight"}
    assert ref["Q4_K_M"]["blk.2.attn_v.weight"] == "Q6_K" and ref["Q4_K_M"]["fc.weight"] == "Q4_K"
    # Q3_K_M: attn_v Q5_K on the first two layers then Q4_K; every ffn_down and attn_output Q4_K (n/16 = 0)
    q3m = ref["Q3_K_M"]
    assert [q3m[f"blk.{i}.attn_v.weight"] for i in range(3)] == ["Q5_K", "Q5_K", "Q4_K"]
    assert {q3m[f"blk.{i}.{r}.weight"] for i in range(3) for r in ("ffn_down", "attn_output")} == {"Q4_K"}
    assert {q3m[f"blk.{i}.{r}.weight"] for i in range(3) for r in ("attn_q", "ffn_up")} | {q3m["fc.weight"]} == {"Q3_K"}
    # llama-quantize's Q2_K mix: gqa 2 < 4 keeps attn_v at Q3_K; ffn_down and attn_output Q3_K
    assert ref["Q2_K_MIX"]["blk.1.attn_v.weight"] == "Q3_K" and ref["Q2_K_MIX"]["blk.1.ffn_gate.weight"] == "Q2_K"
    assert set(ref["Q3_K_S"].values()) == {"Q3_K"} and set(ref["Q2_K_S"].values()) == {"Q2_K"}
    assert set(ref["Q4_K_S"].values()) == {"Q4_K", "Q5_K"} and ref["Q4_K_S"]["blk.2.attn_v.weight"] == "Q5_K"
    big = {m: tensor_types(m, _linears(5), 5, 32, 8) for m in ("Q2_K_MIX", "Q4_K_M")}
    assert big["Q2_K_MIX"]["blk.0.attn_v.weight"] == "Q4_K"  # gqa 4
    # use_more_bits(i, 5): n/8 = 0, 7n/8 = 4, (i - 0) % 3 == 2 -> layers 2 and 4
    assert [big["Q4_K_M"][f"blk.{i}.ffn_down.weight"] for i in range(5)] == ["Q4_K", "Q4_K", "Q6_K", "Q4_K", "Q6_K"]


def test_gptq_mix_writes_each_tensor_on_its_type(tmp_path):
    from dflash_quant.pipeline.job import GptqJob
    from dflash_quant.pipeline.run import run_gptq
    from dflash_quant.quantize.settings import QuantSettings

    out = tmp_path / "q3km"
    run_gptq(
        GptqJob(
            output=out,
            quant=QuantSettings(method="rtn"),
            verify=False,
            write_card=False,
            format="gguf",
            gguf_type="Q3_K_M",
            device="cpu",
        )
    )
    reader = gguf.GGUFReader(str(out / "drafter-Q3_K_M.gguf"))
    kinds = {t.name: t.tensor_type.name for t in reader.tensors if t.tensor_type.name not in ("F32", "BF16")}
    assert kinds == tensor_types("Q3_K_M", list(kinds), 3, 4, 2)
    assert {"Q3_K", "Q4_K", "Q5_K"} == set(kinds.values())
    assert int(reader.fields["general.file_type"].contents()) == 12  # LLAMA_FTYPE_MOSTLY_Q3_K_M
    import json

    prov = json.loads((out / "provenance.json").read_text())
    q = prov["quantization"]
    assert q.get("gguf_type", q.get("extra", {}).get("gguf_type")) == "Q3_K_M"


def test_gguf_type_needs_format_gguf(tmp_path):
    from dflash_quant.pipeline.job import GptqJob
    from dflash_quant.pipeline.run import run_gptq
    from dflash_quant.quantize.settings import QuantSettings

    with pytest.raises(UsageError, match="add --format gguf"):
        run_gptq(GptqJob(output=tmp_path / "x", quant=QuantSettings(method="rtn"), gguf_type="Q4_K"))
    with pytest.raises(UsageError, match="Q7_K.*not supported"):
        run_gptq(GptqJob(output=tmp_path / "y", quant=QuantSettings(method="rtn"), format="gguf", gguf_type="Q7_K"))
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


@pytest.mark.llamacpp
@pytest.mark.skipif(not (LLAMA_BIN / "llama-quantize").is_file(), reason="llama.cpp not built (LLAMA_CPP_BIN)")
@pytest.mark.parametrize("kind", ["Q4_K_M", "Q3_K_S", "Q2_K", "IQ3_XXS", "IQ2_XS"])
def test_llama_quantize_accepts_the_imatrix(tmp_path, kind):
    """llama-quantize --imatrix loads our file and uses it for every tensor (IQ2/IQ3 refuse to run without one)."""
    from dflash_quant.export.gguf import write_gguf
    from dflash_quant.export.gptq_v1 import GptqArtifact
    from dflash_quant.loading.drafter import load_drafter

    names = load_drafter(str(PAIR / "drafter")).model.linear_names()
    stats, _, model = _stats(names)
    imatrix = write_for_stats(tmp_path / "d.imatrix.gguf", stats, names, "test")
    import json

    config = json.loads((PAIR / "drafter" / "config.json").read_text())
    state = {k: v.detach() for k, v in model.state_dict().items() if not k.startswith("rotary_emb.")}
    art = GptqArtifact(
        path=PAIR / "drafter", config=config, qcfg={"bits": 16, "group_size": -1, "sym": True}, dense=state
    )
    (tmp_path / "bf16").mkdir()
    write_gguf(tmp_path / "bf16", art, target=PAIR / "target")
    src = next((tmp_path / "bf16").glob("*.gguf"))
    res = subprocess.run(
        [str(LLAMA_BIN / "llama-quantize"), "--imatrix", str(imatrix), str(src), str(tmp_path / "q.gguf"), kind],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    log = res.stdout + res.stderr
    assert f"loaded {len(names)} importance matrix entries" in log
    assert "did not find weights" not in log and "Missing importance matrix" not in log
    reader = gguf.GGUFReader(str(tmp_path / "q.gguf"))
    assert {t.name for t in reader.tensors} >= {gguf_name(f"{n}.weight") for n in names}
    shutil.rmtree(tmp_path / "bf16")


@pytest.mark.llamacpp
@pytest.mark.skipif(not (LLAMA_BIN / "llama-quantize").is_file(), reason="llama.cpp not built (LLAMA_CPP_BIN)")
def test_mix_types_equal_llama_quantize_choice(tmp_path):
    """For every mix, llama-quantize (no --pure) puts each drafter tensor on the type tensor_types says."""
    import json

    from dflash_quant.export.gguf import write_gguf
    from dflash_quant.export.gptq_v1 import GptqArtifact
    from dflash_quant.loading.drafter import load_drafter
    from dflash_quant.quantize.kmix import LLAMA_QUANTIZE_NAME

    model = load_drafter(str(PAIR / "drafter")).model
    names = [gguf_name(f"{n}.weight") for n in model.linear_names()]
    config = json.loads((PAIR / "drafter" / "config.json").read_text())
    state = {k: v.detach() for k, v in model.state_dict().items() if not k.startswith("rotary_emb.")}
    art = GptqArtifact(
        path=PAIR / "drafter", config=config, qcfg={"bits": 16, "group_size": -1, "sym": True}, dense=state
    )
    (tmp_path / "bf16").mkdir()
    write_gguf(tmp_path / "bf16", art, target=PAIR / "target")
    src = next((tmp_path / "bf16").glob("*.gguf"))
    cfg = model.config
    # Q2_K_S refuses to run without an imatrix; none of these mixes' rules depend on having one
    stats, _, _ = _stats(model.linear_names())
    imatrix = write_for_stats(tmp_path / "d.imatrix.gguf", stats, model.linear_names(), "test")
    for mix in MIXES:
        out = tmp_path / f"{mix}.gguf"
        kind = LLAMA_QUANTIZE_NAME.get(mix, mix)
        res = subprocess.run(
            [str(LLAMA_BIN / "llama-quantize"), "--imatrix", str(imatrix), str(src), str(out), kind],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
        reader = gguf.GGUFReader(str(out))
        theirs = {t.name: t.tensor_type.name for t in reader.tensors if t.name in names}
        ours = tensor_types(mix, names, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads)
        assert theirs == ours, mix
        assert int(reader.fields["general.file_type"].contents()) == MIXES[mix].file_type, mix
        out.unlink()


def test_imatrix_command_refuses_bad_outputs_before_loading(tmp_path):
    from dflash_quant.cli.imatrix_cmd import make_imatrix

    existing = tmp_path / "d.imatrix.gguf"
    existing.write_bytes(b"keep me")
    with pytest.raises(UsageError, match="exists; pass --overwrite"):
        make_imatrix("reference", None, existing)
    assert existing.read_bytes() == b"keep me"
    with pytest.raises(UsageError, match="is a directory"):
        make_imatrix("reference", None, tmp_path)
    with pytest.raises(UsageError, match="does not exist"):
        make_imatrix("reference", None, tmp_path / "missing" / "x.gguf")
