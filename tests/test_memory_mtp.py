"""MTP vs DFlash budget (`budget --compare-mtp`): hand-computed numbers for a Qwen3.5-27B-shaped target,
a tiny checkpoint with real mtp.* tensors, and the errors."""

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from dflash_quant.errors import UsageError
from dflash_quant.memory.budget import BudgetSettings, resolve_drafter, resolve_target
from dflash_quant.memory.engine import padding_layers, vllm_group_size
from dflash_quant.memory.mtp import compare_mtp, mtp_head, mtp_param_count, resolve_mtp_weights
from tests.tiny import hybrid_target_config, save_hybrid_target

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
H, INTER, V = 5120, 17408, 248320


def _settings(**kw):
    base = dict(gpu_name="rtx4090", gpu_bytes=24 * GiB, context=8192, spec_tokens=15, max_num_seqs=8,
                gpu_memory_utilization=0.95, state_dtype="bf16")  # fmt: skip
    return BudgetSettings(**{**base, **kw})


def _compare(**kw):
    return compare_mtp(resolve_target("qwen3.5-27b", "int4"), resolve_drafter("qwen3.6-27b-dflash"), _settings(**kw))


def test_qwen35_27b_mtp_head_weights_by_hand():
    shape = resolve_target("qwen3.5-27b", "int4").shape
    head = mtp_head(shape)
    assert (head.num_layers, head.dedicated_embeddings) == (1, False)
    fc = 2 * H * H
    attn = H * (2 * 24 * 256) + 2 * H * (4 * 256) + (24 * 256) * H  # gated q, k, v, o
    mlp = 3 * H * INTER
    norms = 2 * 256 + 2 * H + H + 2 * H  # q/k norm, 2 layer norms, final norm, 2 pre-fc norms
    params = fc + attn + mlp + norms
    assert mtp_param_count(shape, head).total_params == params == 424_699_392
    w = resolve_mtp_weights(shape, head)
    assert w.bytes == 2 * params and w.source == "counted from config at bf16"  # 810.05 MiB


@pytest.mark.parametrize("ctx", [8192, 32768])
def test_every_term_matches_hand_calculation(ctx):
    rep = _compare(context=ctx)
    m = rep["methods"]
    assert list(m) == ["none", "mtp-k1", "mtp-k2", "mtp-k3", "dflash-bf16", "dflash-int4"]
    conv_dim, state = 2 * 16 * 128 + 48 * 128, 48 * 128 * 128
    slot = lambda k: (3 + k) * conv_dim * 2 + state * 2  # noqa: E731  one GDN layer, one slot, bf16
    # vLLM pads a state page to a whole attention block of 16-token multiples at 4 KiB/token (memory/hybrid.py)
    block = lambda k: 16 * -(-slot(k) // (16 * 4096))  # noqa: E731
    page = lambda k: block(k) * 4096  # noqa: E731
    tokens = lambda k: -(-ctx // block(k)) * block(k)  # noqa: E731
    for k in (1, 2, 3):
        c = m[f"mtp-k{k}"]["components"]
        assert c["target_state"] == (2 + k) * 48 * page(k)  # 2 + K slots (prefix caching on), widened conv
        assert c["draft_kv"] == 2 * 4 * 256 * 2 * tokens(k)  # the MTP layer: 4 kv heads x 256, 4 KiB/token
        assert c["kv_group_padding"] == 3 * (2 + k) * page(k)  # 17 full + 48 GDN -> groups of 17, 3 pads
        assert c["target_kv"] == 64 * KiB * tokens(k)
        assert c["draft_weights"] == 849_398_784
        assert m[f"mtp-k{k}"]["state_slots"] == 2 + k
    assert slot(1) == 1_654_784 and block(1) == 416  # 158,859,264 B raw for 2 slots: 151.50 MiB
    none = m["none"]["components"]
    assert none["target_state"] == 2 * 48 * page(0) and none["kv_group_padding"] == 0
    for name in ("dflash-bf16", "dflash-int4"):
        c = m[name]["components"]
        assert c["target_state"] == 17 * 48 * page(15)  # 17 slots, bf16 (raw 1.39 GiB for 16: field notes)
        assert c["kv_group_padding"] == 0  # drafter layers (8 kv heads x 128) are buckets of their own
        assert c["target_kv"] == 64 * KiB * tokens(15)
    for b in m.values():
        c = b["components"]
        assert b["required_bytes"] == sum(c.values())
        assert b["headroom_bytes"] == b["usable_bytes"] - b["required_bytes"]
        assert b["per_request_speculation_bytes"] == b["per_request_bytes"] - m["none"]["per_request_bytes"]
    # DFlash's per-request speculation cost is its 15 extra state slots, its context KV and the target KV's
    # larger block rounding at K=15
    spec = m["dflash-int4"]["per_request_speculation_bytes"]
    extra_kv = 64 * KiB * (tokens(15) - tokens(0))
    assert spec == 17 * 48 * page(15) - 2 * 48 * page(0) + m["dflash-int4"]["components"]["draft_kv"] + extra_kv


def test_dflash_columns_equal_plain_budget():
    from dflash_quant.memory.budget import compare_drafters

    plain = compare_drafters(resolve_target("qwen3.5-27b", "int4"), resolve_drafter("qwen3.6-27b-dflash"), _settings())
    m = _compare()["methods"]
    for form, name in (("bf16", "dflash-bf16"), ("int4", "dflash-int4")):
        assert m[name]["required_bytes"] == plain[form].required_bytes
        assert m[name]["max_context"] == plain[form].max_context
        assert m[name]["max_concurrency"] == plain[form].max_concurrency


def test_max_concurrency_and_crossover_are_the_largest_that_fit():
    rep = _compare()
    m = rep["methods"]
    # 4 since prefix caching (vLLM's default for hybrids) keeps a third state page per request at K=1
    assert (m["mtp-k1"]["max_concurrency"], m["dflash-int4"]["max_concurrency"]) == (4, 1)
    assert not m["dflash-bf16"]["fits"] and m["dflash-int4"]["fits"]
    x = rep["crossover"]["mtp-k1 vs dflash-int4"]
    assert x["only_first_fits"] == [2, 4] and x["order_changes_at"] is None and x["cheaper_at_1"] == "mtp-k1"
    at = _compare(concurrency=4)["methods"]["mtp-k1"]
    above = _compare(concurrency=5)["methods"]["mtp-k1"]
    assert at["fits"] and not above["fits"]


def test_vllm_group_padding_rule():
    assert vllm_group_size([17, 48]) == 17 and padding_layers({"full": 17, "state": 48}) == {"full": 0, "state": 3}
    assert padding_layers({"full": 16, "state": 48}) == {"full": 0, "state": 0}
    assert vllm_group_size([12, 13]) == 13  # vLLM's gpt-oss + eagle example: within 1.5x, the largest
    assert padding_layers({"full": 16, "drafter": 5, "state": 48}) == {"full": 4, "drafter": 0, "state": 2}


def test_config_without_mtp_head_is_refused():
    with pytest.raises(UsageError, match="no MTP head"):
        compare_mtp(resolve_target("qwen3-8b", "int4"), resolve_drafter("qwen3-8b-dflash-b16"), _settings())
    with pytest.raises(UsageError, match="vLLM only"):
        _compare(engine="reference")
    with pytest.raises(UsageError, match="multiple"):
        compare_mtp(
            resolve_target("qwen3.5-27b", "int4"),
            resolve_drafter("qwen3.6-27b-dflash"),
            _settings(),
            mtp_tokens=(3,),
            mtp_weights=None,
        ) if False else _mtp_two_layers_k3()


def _mtp_two_layers_k3():
    from dflash_quant.memory.mtp import MTPHead, MTPWeights, mtp_method

    t = resolve_target("qwen3.5-27b", "int4")
    mtp_method(t, MTPHead(2, False), MTPWeights(0, "-", 0), _settings(), 3)


def _mtp_state_dict(cfg) -> dict[str, torch.Tensor]:
    """Real MTP tensors for a tiny Qwen3.5 text config: a transformers full-attention decoder layer, fc, norms."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer

    torch.manual_seed(3)
    layer_cfg = hybrid_target_config(layer_types=["full_attention"], num_hidden_layers=1)
    layer = Qwen3_5DecoderLayer(layer_cfg, 0)
    h = cfg.hidden_size
    out = {f"mtp.layers.0.{k}": v.detach().clone() for k, v in layer.state_dict().items()}
    out["mtp.fc.weight"] = torch.randn(h, 2 * h)
    for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        out[f"mtp.{name}.weight"] = torch.ones(h)
    return out


@pytest.fixture(scope="module")
def tiny_mtp_target(tmp_path_factory):
    path = tmp_path_factory.mktemp("mtp_target")
    save_hybrid_target(path, mtp_num_hidden_layers=1)
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["mtp_num_hidden_layers"] == 1
    weights = load_file(str(path / "model.safetensors"))
    mtp = _mtp_state_dict(hybrid_target_config())
    save_file({**weights, **mtp}, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path, mtp


def test_tiny_checkpoint_mtp_bytes_from_files(tiny_mtp_target):
    path, mtp = tiny_mtp_target
    h, i, heads, kvh, hd = 64, 128, 4, 2, 16
    params = 2 * h * h + h * 2 * heads * hd + 2 * h * kvh * hd + heads * hd * h + 3 * h * i + 2 * hd + 5 * h
    assert sum(v.numel() for v in mtp.values()) == params  # the real module has exactly the counted parameters
    t = resolve_target(str(path))
    head = mtp_head(t.shape)
    assert mtp_param_count(t.shape, head).total_params == params
    w = resolve_mtp_weights(t.shape, head, path)
    assert w.bytes == 4 * params and w.file_bytes_in_target == 4 * params  # float32 tensors, from headers
    assert "checkpoint" in w.source
    rep = compare_mtp(t, resolve_drafter("qwen3-8b-dflash-b16"), _settings(gpu_bytes=GiB, context=256), root=path)
    for b in rep["methods"].values():
        assert b["components"]["target_weights"] == t.weight_bytes - 4 * params  # the target never loads mtp.*
    assert rep["methods"]["mtp-k2"]["components"]["draft_weights"] == 4 * params
    assert rep["methods"]["mtp-k1"]["kv_padding_layers"] == {"state": 1}  # 2 full (target + MTP), 3 GDN -> 4


@pytest.mark.slow  # two CLI subprocesses that import torch for a model directory (~25 s on 2 cores)
def test_cli_compare_mtp_with_tiny_checkpoint(tiny_mtp_target, tmp_path):
    from tests.tiny import save_drafter

    path, mtp = tiny_mtp_target
    drafter = save_drafter(tmp_path / "drafter")
    cmd = [
        sys.executable,
        "-m",
        "dflash_quant.cli.app",
        "budget",
        "--target",
        str(path),
        "--drafter",
        str(drafter),
        "--gpu",
        "1GiB",
        "--context",
        "256",
        "--runtime-overhead",
        "0",
        "--cuda-graphs",
        "0",
        "--compare-mtp",
        "--json",
    ]
    res = subprocess.run(cmd, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    rep = json.loads(res.stdout)["compare_mtp"]
    mtp_bytes = 4 * sum(v.numel() for v in mtp.values())
    assert rep["mtp"]["weight_bytes"] == mtp_bytes
    total = resolve_target(str(path)).weight_bytes
    for b in rep["methods"].values():
        assert b["components"]["target_weights"] == total - mtp_bytes  # the target never loads mtp.*
    assert rep["methods"]["mtp-k1"]["components"]["draft_weights"] == mtp_bytes
    # 3 GDN + 1 full layers; the MTP layer makes 2 full -> groups of 2, the GDN bucket 3 -> 4 (one pad)
    assert rep["methods"]["mtp-k1"]["kv_padding_layers"] == {"state": 1}
    table = subprocess.run(cmd[:-1], capture_output=True, text=True, env={**os.environ, "COLUMNS": "200"})
    assert table.returncode == 0 and "mtp-k1" in table.stdout and "kv group padding" in table.stdout


def test_cli_compare_mtp_table_and_json_for_presets():
    base = [sys.executable, "-m", "dflash_quant.cli.app", "budget", "--target", "qwen3.5-27b", "--drafter",
            "qwen3.6-27b-dflash", "--target-weights", "int4", "--max-num-seqs", "8", "--gpu-memory-utilization",
            "0.95", "--state-dtype", "bf16", "--compare-mtp"]  # fmt: skip
    res = subprocess.run(base + ["--json"], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    m = json.loads(res.stdout)["compare_mtp"]["methods"]
    assert m == _compare()["methods"]
    table = subprocess.run(base + ["--mtp-tokens", "1"], capture_output=True, text=True,
                           env={**os.environ, "COLUMNS": "200"})  # fmt: skip
    assert table.returncode == 0, table.stderr
    assert "mtp-k1" in table.stdout and "mtp-k2" not in table.stdout and "kv group padding" in table.stdout


def test_cli_no_mtp_head_is_a_one_line_error(tmp_path):
    cmd = [
        sys.executable,
        "-m",
        "dflash_quant.cli.app",
        "budget",
        "--target",
        "qwen3-8b",
        "--drafter",
        "qwen3-8b-dflash-b16",
        "--compare-mtp",
    ]
    res = subprocess.run(cmd, capture_output=True, text=True)
    assert res.returncode != 0 and "no MTP head" in res.stderr
    assert len([ln for ln in res.stderr.splitlines() if ln.strip()]) == 1
    res = subprocess.run(cmd[:-1] + ["--mtp-tokens", "2"], capture_output=True, text=True)
    assert res.returncode != 0 and "--compare-mtp" in res.stderr


def test_embedded_budget_and_card_gain_the_comparison_only_with_an_mtp_head():
    from dflash_quant.artifact.reports import MemoryReport
    from dflash_quant.memory.plan import embedded_budget
    from dflash_quant.model_cards.deployment import mtp_comparison, section_mtp_comparison

    with_head = embedded_budget("qwen3.5-27b", "qwen3.6-27b-dflash")
    cmp = with_head.compare_mtp
    # the head's KV in whole hybrid blocks: K=1, fp32 state -> 800-token blocks, 8192 -> 8800 tokens
    assert cmp["methods"]["mtp-k1"]["components"]["draft_kv"] == 4 * KiB * 8800
    ctx = {"memory": MemoryReport.from_dict({"budget_24gb": with_head.to_dict()})}
    text = section_mtp_comparison(ctx)
    assert "MTP or DFlash" in text and "| state slots (1 or 2 + K) | 2 | 3 | 4 | 5 | 17 | 17 |" in text
    assert "810.05 MiB" in text and "kv group padding" in text
    without = embedded_budget("qwen3-8b", "qwen3-8b-dflash-b16")
    assert without.compare_mtp is None and "compare_mtp" not in without.to_dict()
    assert mtp_comparison({"memory": MemoryReport.from_dict({"budget_24gb": without.to_dict()})}) is None
