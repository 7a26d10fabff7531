"""Builders for realistic quantized-drafter artifacts (docs/artifact.md) used by the card and push tests.

Imported explicitly by tests/test_card.py, tests/test_push.py and tests/test_hub_cli.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from dflash_quant.artifact.manifest import write_manifest

SOURCE_ID = "z-lab/Qwen3-8B-DFlash-b16"
TARGET_ID = "Qwen/Qwen3-8B"
FAKE_TOKEN = "hf_dflashTESTtokenNEVERprintXq9Zk27"

HIDDEN = 256
INTER = 512
LAYERS = 2
BLOCK = 8


def _gptq_linear(prefix: str, out_f: int, in_f: int, gen: torch.Generator, group: int = 128) -> dict:
    return {
        f"{prefix}.qweight": torch.randint(-(2**31), 2**31 - 1, (in_f // 8, out_f), dtype=torch.int32, generator=gen),
        f"{prefix}.qzeros": torch.full((in_f // group, out_f // 8), 0x77777777, dtype=torch.int32),
        f"{prefix}.scales": (torch.rand(in_f // group, out_f, generator=gen) * 0.01).to(torch.float16),
        f"{prefix}.g_idx": (torch.arange(in_f, dtype=torch.int32) // group),
    }


def write_weights(path: Path, *, big_bytes: int = 0) -> list[str]:
    """A GPTQ v1 drafter state dict; `big_bytes` adds a bf16 tensor of about that size (LFS path)."""
    gen = torch.Generator().manual_seed(0)
    tensors: dict[str, torch.Tensor] = {}
    names = []
    tensors.update(_gptq_linear("fc", HIDDEN, 3 * HIDDEN, gen))
    names.append("fc")
    for i in range(LAYERS):
        p = f"layers.{i}"
        for proj in ("q_proj", "k_proj", "v_proj"):  # vLLM profile: q/k/v stay bf16
            tensors[f"{p}.self_attn.{proj}.weight"] = torch.randn(HIDDEN, HIDDEN, generator=gen).to(torch.bfloat16)
        tensors.update(_gptq_linear(f"{p}.self_attn.o_proj", HIDDEN, HIDDEN, gen))
        tensors.update(_gptq_linear(f"{p}.mlp.gate_proj", INTER, HIDDEN, gen))
        tensors.update(_gptq_linear(f"{p}.mlp.up_proj", INTER, HIDDEN, gen))
        tensors.update(_gptq_linear(f"{p}.mlp.down_proj", HIDDEN, INTER, gen))
        names += [f"{p}.self_attn.o_proj", f"{p}.mlp.gate_proj", f"{p}.mlp.up_proj", f"{p}.mlp.down_proj"]
        for norm in ("input_layernorm", "post_attention_layernorm", "self_attn.q_norm", "self_attn.k_norm"):
            tensors[f"{p}.{norm}.weight"] = torch.ones(HIDDEN if "layernorm" in norm else 64, dtype=torch.bfloat16)
    tensors["hidden_norm.weight"] = torch.ones(HIDDEN, dtype=torch.bfloat16)
    tensors["norm.weight"] = torch.ones(HIDDEN, dtype=torch.bfloat16)
    if big_bytes:
        tensors["padding_for_tests"] = torch.randn(big_bytes // 2, generator=gen).to(torch.bfloat16)
    save_file(tensors, str(path), metadata={"format": "pt", "quantized_by": "dflash-quant 0.1.0"})
    return names


QCONFIG = {
    "quant_method": "gptq",
    "bits": 4,
    "group_size": 128,
    "desc_act": False,
    "sym": True,
    "static_groups": False,
    "checkpoint_format": "gptq",
    "damp_percent": 0.01,
    "true_sequential": True,
}


def make_artifact(
    root: Path,
    *,
    big_bytes: int = 3 * 1024 * 1024,
    parity: bool = True,
    parity_passed: bool = True,
    memory: bool = True,
    quant_report: bool = True,
    card: bool = True,
    source_id: str = SOURCE_ID,
) -> Path:
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    names = write_weights(root / "model.safetensors", big_bytes=big_bytes)
    config = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": HIDDEN,
        "intermediate_size": INTER,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "vocab_size": 151936,
        "block_size": BLOCK,
        "num_target_layers": 36,
        "dflash_config": {"mask_token_id": 151669, "target_layer_ids": [1, 17, 33]},
        "torch_dtype": "bfloat16",
        "quantization_config": dict(QCONFIG),
    }
    (root / "config.json").write_text(json.dumps(config, indent=2))
    (root / "quantize_config.json").write_text(json.dumps(QCONFIG, indent=2))
    provenance = {
        "tool": "dflash-quant",
        "tool_version": "0.1.0",
        "created_utc": "2026-11-30T12:00:00Z",
        "command": [
            "dflash-quant",
            "gptq",
            "--drafter",
            source_id,
            "--target",
            TARGET_ID,
            "--bits",
            "4",
            "--output",
            str(root),
        ],
        "source_drafter": {
            "id": source_id,
            "revision": "0123456789abcdef0123456789abcdef01234567",
            "sha256": "ab" * 32,
        },
        "target": {"id": TARGET_ID, "revision": "fedcba9876543210fedcba9876543210fedcba98"},
        "calibration": {
            "prompts": "builtin:calibration",
            "num_prompts": 64,
            "max_new_tokens": 128,
            "rows": {n: 4096 + 16 * i for i, n in enumerate(names)},
            "kv_hessian": "block",
            "seed": 0,
        },
        "quantization": {
            "method": "gptq",
            "bits": 4,
            "group_size": 128,
            "sym": True,
            "desc_act": False,
            "static_groups": False,
            "damp": 0.01,
            "sequential": True,
            "profile": "vllm",
            "skipped": [f"layers.{i}.self_attn.{p}" for i in range(LAYERS) for p in ("q_proj", "k_proj", "v_proj")],
        },
    }
    (root / "provenance.json").write_text(json.dumps(provenance, indent=2))
    if quant_report:
        layers = [
            {
                "name": n,
                "shape": [HIDDEN, HIDDEN],
                "bits": 4,
                "group_size": 128,
                "hessian_rows": 4096,
                "damp": 0.01,
                "fallback": None,
                "rel_output_error": round(0.011 + 0.002 * i, 4),
            }
            for i, n in enumerate(names)
        ]
        layers[-1]["fallback"] = "rtn: Hessian not positive definite"
        (root / "quant_report.json").write_text(
            json.dumps(
                {"layers": layers, "quantized_bytes": 1_187_840, "original_bytes": 4_194_304, "seconds": 3.25}, indent=2
            )
        )
    if parity:
        base = {
            "drafter": source_id,
            "tau": 4.2137,
            "per_position_acceptance": [0.93, 0.81, 0.66, 0.52, 0.4, 0.3, 0.21],
            "acceptance_histogram": [5, 9, 14, 20, 25, 22, 15, 10],
            "lossless": True,
            "steps": 120,
            "target_forwards": 136,
            "drafter_forwards": 120,
            "new_tokens": 505,
            "spec_seconds": 1.2,
            "spec_tokens_per_s": 420.0,
            "baseline_seconds": 2.9,
            "baseline_tokens_per_s": 174.0,
            "speedup": 2.41,
            "per_prompt": [],
        }
        quant = dict(
            base,
            drafter=str(root),
            tau=4.1561 if parity_passed else 3.512,
            per_position_acceptance=[0.92, 0.8, 0.64, 0.51, 0.39, 0.29, 0.2]
            if parity_passed
            else [0.85, 0.7, 0.5, 0.4, 0.3, 0.2, 0.1],
            spec_tokens_per_s=411.5,
            speedup=2.36,
        )
        ratio = round(quant["tau"] / base["tau"], 4)
        (root / "parity.json").write_text(
            json.dumps(
                {
                    "passed": parity_passed,
                    "tolerance": 0.03,
                    "tau_ratio": ratio,
                    "lossless": True,
                    "reasons": [] if parity_passed else [f"tau ratio {ratio} below 0.97"],
                    "temperature": 0.0,
                    "prompt_set": "builtin:heldout",
                    "num_prompts": 16,
                    "max_new_tokens": 96,
                    "block_size": BLOCK,
                    "baseline": base,
                    "quantized": quant,
                },
                indent=2,
            )
        )
    if memory:
        (root / "memory.json").write_text(
            json.dumps(
                {
                    "artifact": str(root),
                    "weights": {
                        "total_bytes": 1_534_976,
                        "by_module": {"fc": 110_592},
                        "by_dtype": {"int32": 1_179_648, "float16": 36_864, "bfloat16": 318_464},
                    },
                    "disk_bytes": 1_552_384,
                    "baseline": {"path": source_id, "total_bytes": 5_242_880, "disk_bytes": 5_243_392, "ratio": 0.2928},
                    "resident": {"device": "cpu", "bytes": 1_540_096, "method": "tensor bytes"},
                    "context_kv_bytes_per_token": 20_480,
                    "budget_24gb": {  # the shape of memory/plan.budget_report (artifact.reports.Budget)
                        "gpu": {"name": "rtx4090", "total_bytes": 25_769_803_776},
                        "engine": "vllm",
                        "settings": {"context": 8192, "concurrency": 1, "spec_tokens": 7},
                        "target": {"source": "Qwen/Qwen3-8B", "weight_bytes": 5_800_000_000, "weight_format": "int4"},
                        "budgets": {
                            form: {
                                "drafter_form": form,
                                "usable_bytes": 23_192_823_398,
                                "required_bytes": req,
                                "headroom_bytes": 23_192_823_398 - req,
                                "fits": req <= 23_192_823_398,
                                "max_context": ctx,
                                "max_context_limited_by": "memory",
                                "components": {"drafter_weights": w},
                                "notes": [],
                            }
                            for form, req, ctx, w in (
                                ("bf16", 19_971_597_926, 30_000, 5_242_880),
                                ("int4", 16_750_372_454, 32_768, 1_534_976),
                            )
                        },
                    },
                },
                indent=2,
            )
        )
    if card:  # as the export does: the card inside the export, then the manifest over everything
        from dflash_quant.model_cards.card import write_card

        write_card(root)
    write_manifest(root)
    return root
