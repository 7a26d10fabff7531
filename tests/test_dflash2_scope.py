"""What is quantized in a DFlash2 drafter: the --quantize-conv / --quantize-selector flags (calibration hooks,
GPTQ v1 export, reload), the engine profiles, whole-drafter bytes in quant_report.json, and the budget preset."""

import json
import random
import re

import pytest
import torch
from safetensors import safe_open
from tiny import save_dflash2_drafter, save_drafter, save_target

from dflash_quant.calibration.capture import capture
from dflash_quant.errors import UsageError
from dflash_quant.io.gptq_v1 import unpack_gptq_v1
from dflash_quant.io.weights import read_header
from dflash_quant.loading.drafter import load_drafter
from dflash_quant.memory.weights import DRAFTER_PARTS, part_of
from dflash_quant.pipeline.job import GptqJob
from dflash_quant.pipeline.run import run_gptq
from dflash_quant.quantize.drafter import candidate_linears, select_linears
from dflash_quant.quantize.settings import QuantSettings


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("d2scope")
    rng = random.Random(0)

    def line() -> str:
        return " ".join(f"w{rng.randint(3, 119)}" for _ in range(8))

    (root / "calib.txt").write_text("\n".join(line() for _ in range(4)))
    return {
        "root": root,
        "drafter": save_dflash2_drafter(root / "drafter", std=0.2),
        "v1": save_drafter(root / "v1", std=0.2),
        "target": save_target(root / "target"),
    }


def _job(pair, out, **quant):
    return GptqJob(
        output=pair["root"] / out,
        drafter=str(pair["drafter"]),
        target=str(pair["target"]),
        quant=QuantSettings(group_size=16, **quant),
        calib_prompts=str(pair["root"] / "calib.txt"),
        calib_max_new_tokens=12,
        verify=False,
        device="cpu",
        dtype="float32",
    )


def _prompts(pair):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(pair["target"])
    return [tok(text)["input_ids"] for text in (pair["root"] / "calib.txt").read_text().splitlines()]


def test_extra_hooks_only_when_asked_and_they_see_what_the_linears_see(pair):
    from transformers import AutoModelForCausalLM

    drafter = load_drafter(str(pair["drafter"])).model
    target = AutoModelForCausalLM.from_pretrained(pair["target"]).eval()
    prompts = _prompts(pair)[:2]
    plain = capture(drafter, target, prompts, 10)
    assert not any("conv" in k or "selector" in k for k in plain.hessians)

    # an independent witness: hooks on the Linears themselves (the selector's runs inside propose)
    seen: dict[str, torch.Tensor] = {}
    rows: dict[str, int] = {}

    def witness(name):
        def hook(module, args):
            x = args[0].reshape(-1, args[0].shape[-1]).double()
            seen[name] = seen.get(name, 0) + x.T @ x
            rows[name] = rows.get(name, 0) + x.shape[0]

        return hook

    extra = [
        "layers.0.attention_conv.kernel_projection",
        "layers.1.mlp_conv.kernel_projection",
        "candidate_selector.hidden_projection",
    ]
    handles = [drafter.get_submodule(n).register_forward_pre_hook(witness(n)) for n in extra]
    try:
        stats = capture(drafter, target, prompts, 10, extra=extra)
    finally:
        for h in handles:
            h.remove()
    assert set(extra) <= set(stats.hessians)
    assert not {k for k in stats.hessians if "conv" in k} - set(extra)  # only the asked-for convs
    for name in extra:
        acc = stats.hessians[name]
        assert acc.rows == rows[name] > 0
        assert torch.allclose(acc.xtx.double(), seen[name], rtol=1e-4, atol=1e-6), name
    # kernel_projection reads every block row, like q; the selector only the rows after each anchor
    qkv_rows = stats.hessians["layers.0.self_attn.qkv"].rows
    assert stats.hessians["layers.0.attention_conv.kernel_projection"].rows == qkv_rows
    assert 0 < stats.hessians["candidate_selector.hidden_projection"].rows < qkv_rows


def test_quantized_conv_and_selector_round_trip(pair):
    res = run_gptq(_job(pair, "extras", quantize_conv=True, quantize_selector=True))
    art = pair["root"] / "extras"
    names = [layer["name"] for layer in res.quant_report["layers"]]
    assert names[:2] == ["fc", "layers.0.attention_conv.kernel_projection"]  # execution order
    assert {"layers.1.mlp_conv.kernel_projection", "candidate_selector.hidden_projection"} <= set(names)
    assert len(names) == 1 + 2 * (7 + 2) + 1

    cfg = json.loads((art / "config.json").read_text())
    qc = cfg["quantization_config"]
    assert qc["dflash_quant"]["quantize_conv"] is True and qc["dflash_quant"]["quantize_selector"] is True
    assert not qc.get("dynamic")  # every Linear is packed: no negative rule may hide one

    src = load_drafter(str(pair["drafter"])).model.state_dict()
    again = load_drafter(str(art)).model.state_dict()
    with safe_open(str(art / "model.safetensors"), "pt") as fh:
        keys = set(fh.keys())
        for name in ("layers.0.attention_conv.kernel_projection", "candidate_selector.hidden_projection"):
            assert f"{name}.weight" not in keys
            parts = {p: fh.get_tensor(f"{name}.{p}") for p in ("qweight", "qzeros", "scales", "g_idx")}
            w = unpack_gptq_v1(parts, bits=4, group_size=16)
            assert torch.equal(again[f"{name}.weight"], w), name  # the loader dequantizes exactly
            assert not torch.equal(w, src[f"{name}.weight"])  # really quantized
            rel = (w - src[f"{name}.weight"]).norm() / src[f"{name}.weight"].norm()
            assert rel < 0.2, (name, float(rel))
        for key in (
            "layers.0.attention_conv.base_kernel",
            "candidate_selector.predecessor_codebook",
            "candidate_selector.successor_codebook",
        ):  # never quantized
            assert fh.get_tensor(key).dtype == torch.bfloat16
            assert torch.equal(again[key], src[key].to(torch.bfloat16).float()), key


def test_only_conv_quantized_keeps_a_rule_for_the_selector(pair):
    run_gptq(_job(pair, "conv_only", method="rtn", quantize_conv=True))
    cfg = json.loads((pair["root"] / "conv_only" / "config.json").read_text())
    assert set(cfg["quantization_config"]["dynamic"]) == {r"-:(^|.*\.)candidate_selector\.hidden_projection$"}
    with safe_open(str(pair["root"] / "conv_only" / "model.safetensors"), "pt") as fh:
        assert "layers.1.mlp_conv.kernel_projection.qweight" in set(fh.keys())
        assert "candidate_selector.hidden_projection.weight" in set(fh.keys())


def test_whole_drafter_bytes_match_the_written_file(pair):
    res = run_gptq(_job(pair, "bytes", method="rtn"))
    rep = json.loads((pair["root"] / "bytes" / "quant_report.json").read_text())
    assert rep == {**res.quant_report}
    header = read_header(pair["root"] / "bytes" / "model.safetensors")
    on_disk = sum(i["data_offsets"][1] - i["data_offsets"][0] for i in header.values())
    assert rep["drafter_bytes_quantized"] == on_disk
    source = read_header(pair["drafter"] / "model.safetensors")

    def numel(info) -> int:
        return torch.Size(info["shape"]).numel()

    assert rep["drafter_bytes_bf16"] == sum(2 * numel(i) for i in source.values())
    for form, total in (("bf16", rep["drafter_bytes_bf16"]), ("quantized", rep["drafter_bytes_quantized"])):
        parts = rep["by_part"][form]
        assert list(parts) == list(DRAFTER_PARTS) and sum(parts.values()) == total, form
    # conv, codebooks, selector projection and norms are bf16 by default: same bytes in both forms
    for part in ("conv", "selector_codebooks", "selector_projection", "norms"):
        assert rep["by_part"]["bf16"][part] == rep["by_part"]["quantized"][part] > 0, part
    cfg = json.loads((pair["drafter"] / "config.json").read_text())["dflash_config"]
    vocab = json.loads((pair["drafter"] / "config.json").read_text())["vocab_size"]
    assert rep["by_part"]["bf16"]["selector_codebooks"] == vocab * cfg["selector_rank"] * 2 * 2
    assert rep["by_part"]["quantized"]["backbone_linears"] < rep["by_part"]["bf16"]["backbone_linears"] / 2
    # the card and memory.json show the parts
    card = (pair["root"] / "bytes" / "README.md").read_text()
    assert "selector codebooks" in card and "Whole drafter by part" in card
    mem = json.loads((pair["root"] / "bytes" / "memory.json").read_text())
    assert mem["weights"]["by_part"] == rep["by_part"]["quantized"]


def test_part_of():
    assert part_of("layers.0.attention_conv.base_kernel") == "conv"
    assert part_of("layers.3.mlp_conv.kernel_projection.qweight") == "conv"
    assert part_of("candidate_selector.successor_codebook") == "selector_codebooks"
    assert part_of("candidate_selector.hidden_projection.weight") == "selector_projection"
    assert part_of("layers.1.self_attn.q_norm.weight") == "norms"
    assert part_of("layers.1.post_attention_layernorm.weight") == "norms"
    assert part_of("hidden_norm.weight") == part_of("norm.weight") == "norms"
    assert part_of("fc.scales") == "fc"
    assert part_of("model.layers.1.mlp.down_proj.g_idx") == "backbone_linears"


def test_flags_on_a_v1_drafter_are_one_line_errors(pair):
    v1 = load_drafter(str(pair["v1"])).model
    for flags in ({"quantize_conv": True}, {"quantize_selector": True}):
        with pytest.raises(UsageError) as exc:
            candidate_linears(v1, QuantSettings(**flags))
        msg = str(exc.value)
        assert "\n" not in msg and "DFlash2" in msg and "v1" in msg
    job = _job(pair, "v1_flag", quantize_conv=True)
    job.drafter = str(pair["v1"])
    with pytest.raises(UsageError, match="--quantize-conv only apply to a DFlash2 drafter"):
        run_gptq(job)
    assert not (pair["root"] / "v1_flag").exists()


def test_unpackable_extra_refused_before_compute(pair):
    d2 = load_drafter(str(pair["drafter"])).model  # kernel_projection has 16 outputs: 16 x 3 bits is not int32 words
    with pytest.raises(UsageError, match="kernel_projection .* cannot be packed at 3 bits"):
        select_linears(d2, QuantSettings(bits=3, group_size=16, quantize_conv=True))
    chosen, _ = select_linears(d2, QuantSettings(bits=3, group_size=16))  # default: convs untouched, fine
    assert not any("conv" in n for n in chosen)


def test_profiles(pair):
    d2 = load_drafter(str(pair["drafter"])).model
    qkv = {f"layers.{i}.self_attn.{p}_proj" for i in range(2) for p in "qkv"}
    chosen, kept = select_linears(d2, QuantSettings(group_size=16, profile="vllm"))
    assert set(kept) == qkv and "fc" in chosen
    chosen, kept = select_linears(d2, QuantSettings(group_size=16, profile="sglang"))
    assert set(kept) == qkv | {"fc"} and "fc" not in chosen
    chosen, kept = select_linears(d2, QuantSettings(group_size=16, profile="full"))
    assert kept == [] and not any("conv" in n or "selector" in n for n in chosen)


def test_sglang_profile_export_and_card(pair):
    run_gptq(_job(pair, "sglang", method="rtn", profile="sglang"))
    art = pair["root"] / "sglang"
    rules = set(json.loads((art / "config.json").read_text())["quantization_config"]["dynamic"])
    assert r"-:(^|.*\.)fc$" in rules and r"-:(^|.*\.)self_attn\.qkv_proj$" in rules
    assert r"-:(^|.*\.)attention_conv\.kernel_projection$" in rules
    with safe_open(str(art / "model.safetensors"), "pt") as fh:
        assert fh.get_tensor("fc.weight").dtype == torch.bfloat16
    card = (art / "README.md").read_text()
    assert "`--profile sglang`: q/k/v and `fc` kept bf16" in card
    assert "`fc` is bf16 here" in card and "#39087" in card
    assert "DFlash2 needs a dense target `lm_head`" in card
    assert "every engine (vLLM, SGLang, MLX) keeps the convolutions" in card
    full = pair["root"] / "bytes" / "README.md"
    if full.exists():  # the default-profile artifact of test_whole_drafter_bytes_match_the_written_file
        text = full.read_text()
        assert (
            "**Caveat:** `fc` is packed" in text and "**Caveat:** this artifact quantizes the attention q/k/v" in text
        )


def test_card_warns_about_packed_extras(pair):
    art = pair["root"] / "extras"
    if not art.exists():
        run_gptq(_job(pair, "extras", quantize_conv=True, quantize_selector=True))
    card = (art / "README.md").read_text()
    assert "packs `kernel_projection` and `hidden_projection` as GPTQ" in card


def test_budget_preset_counts_the_dflash2_parts():
    from dflash_quant.memory.budget import resolve_drafter
    from dflash_quant.memory.kv import SLIDING

    d = resolve_drafter("qwen3.8-27b-dflash2")
    assert d.shape.block_size == 8 and d.shape.target_layer_ids == (5, 19, 33, 47, 61)
    assert list(d.shape.layer_types) == [SLIDING] * 5 and d.shape.sliding_window == 2048
    h, vocab, rank, layers, kernel, groups = 5120, 248320, 256, 5, 2, 5120 // 16
    codebooks = vocab * rank * 2 * 2  # two codebooks, bf16
    assert codebooks == 254_279_680
    assert d.bf16_parts["selector_codebooks"] == d.quantized_parts["selector_codebooks"] == codebooks
    conv = layers * 2 * (2 * kernel * h + h * 2 * kernel * groups) * 2  # 2 convs/layer: base_kernel + projection
    assert d.bf16_parts["conv"] == d.quantized_parts["conv"] == conv
    assert d.bf16_parts["selector_projection"] == h * rank * 2
    assert d.bf16_bytes == sum(d.bf16_parts.values()) == 3_848_808_960  # 1.92 B params, 3.85 GB (published)
    assert d.quantized_bytes == sum(d.quantized_parts.values())
    share = codebooks / d.quantized_bytes
    assert 0.19 < share < 0.20  # 19.7 % of the int4 drafter


def test_cli_flag_on_v1_drafter_exits_2_with_one_line(tmp_path):
    import os
    import subprocess
    import sys

    out = tmp_path / "art"
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "dflash_quant.cli.app",
            "gptq",
            "reference",
            "--quantize-selector",
            "--no-verify",
            "--output",
            str(out),
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        timeout=300,
    )
    assert res.returncode == 2, res.stderr
    # a refusal found once the models are loaded: after the "[hh:mm:ss] loading ..." progress line of a log
    lines = [ln for ln in res.stderr.splitlines() if ln.strip() and not re.match(r"\[\d\d:\d\d:\d\d\] ", ln)]
    assert len(lines) == 1 and "--quantize-selector only apply to a DFlash2 drafter" in lines[0], res.stderr
    assert not out.exists()


def test_sequential_gptq_replays_the_extras(pair):
    # replay never proposes, so the selector's rows must come from the drafter's forward output
    res = run_gptq(_job(pair, "sequential", sequential=True, quantize_conv=True, quantize_selector=True))
    rows = {layer["name"]: layer["hessian_rows"] for layer in res.quant_report["layers"]}
    assert rows["candidate_selector.hidden_projection"] > 0
    assert rows["layers.1.mlp_conv.kernel_projection"] == rows["layers.1.self_attn.o_proj"]  # block rows, same count
