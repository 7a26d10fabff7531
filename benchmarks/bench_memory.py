"""Validate `dflash-quant budget --engine reference` against measured peak memory.

For each case: build/load a target + DFlash drafter in bf16, run `speculative_generate` on a random prompt of
(context - new_tokens) tokens for new_tokens tokens, and measure the peak of allocated memory during the run
(CUDA: torch.cuda.max_memory_allocated; CPU: a dispatch-mode tracker of live tensor storage, for smoke runs).
The prediction comes from the budget model alone (weights counted from the config, caches and activations
from the formulas), never from the measured run.

Cases:
  reference  the shipped reference pair (dflash_quant/reference/pair/{target,drafter}); skipped if absent
  qwen3-8b   randomly initialised Qwen3-8B-shaped target + Qwen3-8B-DFlash-b16-shaped drafter (bf16, on the GPU)
  small      tiny random shapes (CPU smoke test)

Usage (one H200, ~2 minutes):
  .venv/bin/python benchmarks/bench_memory.py --device cuda --cases reference,qwen3-8b --contexts 4096,16384,32768
CPU smoke:
  .venv/bin/python benchmarks/bench_memory.py --device cpu --cases small --contexts 512,2048
Writes memory_validation.json and memory_validation.md into --out (default $OUT, else benchmarks/results).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import sys
import time
import weakref
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dflash_quant.memory.budget import (  # noqa: E402
    DEFAULT_CUBLAS_WORKSPACE,
    BudgetSettings,
    compute_budget,
    reference_phases,
    resolve_drafter,
    resolve_target,
)
from dflash_quant.memory.gpus import GiB, fmt_bytes  # noqa: E402
from dflash_quant.memory.kv import read_config  # noqa: E402

SHAPES = {
    "qwen3-8b": (
        dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
             num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=40960,
             tie_word_embeddings=False, rope_theta=1e6, rms_norm_eps=1e-6),
        dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=5, num_attention_heads=32,
             num_key_value_heads=8, head_dim=128, vocab_size=151936, block_size=16, num_target_layers=36,
             dflash_config={"mask_token_id": 151669, "target_layer_ids": [1, 9, 17, 25, 33]}),
    ),
    "small": (
        dict(hidden_size=256, intermediate_size=768, num_hidden_layers=6, num_attention_heads=4,
             num_key_value_heads=2, head_dim=64, vocab_size=2048, max_position_embeddings=8192,
             tie_word_embeddings=False, rope_theta=1e6, rms_norm_eps=1e-6),
        dict(hidden_size=256, intermediate_size=768, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=64, vocab_size=2048, block_size=8, num_target_layers=6,
             dflash_config={"mask_token_id": 2047, "target_layer_ids": [1, 4]}),
    ),
}  # fmt: skip


class LiveBytes(TorchDispatchMode):
    """Peak of live tensor storage created inside the mode (CPU stand-in for the CUDA allocator's peak)."""

    def __init__(self, external: set[int]):
        super().__init__()
        self.external = external
        self.refs: dict[int, int] = {}
        self.size: dict[int, int] = {}
        self.current = 0
        self.peak = 0

    def _release(self, key: int) -> None:
        self.refs[key] -= 1
        if self.refs[key] == 0:
            self.current -= self.size.pop(key)
            del self.refs[key]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            st = t.untyped_storage()
            key = st.data_ptr()
            if not key or key in self.external:
                continue
            if key not in self.refs:
                self.refs[key] = 0
                self.size[key] = st.nbytes()
                self.current += st.nbytes()
                self.peak = max(self.peak, self.current)
            self.refs[key] += 1
            weakref.finalize(t, self._release, key)
        return out


def _cleanup(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def _allocated(device: torch.device) -> int:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else 0


def build_random(case: str, device: torch.device):
    from transformers import AutoModelForCausalLM, Qwen3Config

    from dflash_quant.models.config import parse_draft_config
    from dflash_quant.models.model import DFlashDrafter

    t_cfg, d_cfg = SHAPES[case]
    cfg = Qwen3Config(**t_cfg)
    torch.manual_seed(0)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            target = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
            drafter = DFlashDrafter(parse_draft_config(dict(d_cfg), source=case)).to(torch.bfloat16).eval()
        target, drafter = target.to(device), drafter.to(device)
    finally:
        torch.set_default_dtype(prev)
    target_dict = {**t_cfg, "torch_dtype": "bfloat16", "architectures": ["Qwen3ForCausalLM"]}
    drafter_dict = {**d_cfg, "torch_dtype": "bfloat16", "architectures": ["DFlashDraftModel"]}
    return target, drafter, target_dict, drafter_dict


def load_reference(device: torch.device):
    from dflash_quant.loading.drafter import load_drafter
    from dflash_quant.loading.target import load_target
    from dflash_quant.reference import pair_dir

    pair = pair_dir()
    target = load_target(pair / "target", device=device, dtype=torch.bfloat16).model
    drafter = load_drafter(pair / "drafter", device=device, dtype=torch.bfloat16).model
    return target, drafter, str(pair / "target"), str(pair / "drafter")


def run_case(name, target, drafter, t_src, d_src, context, new_tokens, device, gpu_bytes):
    from dflash_quant.speculative.decode import speculative_generate

    max_pos = getattr(target.config, "max_position_embeddings", None) or context
    if context > max_pos:
        return {"case": name, "context": context, "skipped": f"context > max_position_embeddings {max_pos}"}
    prompt = context - new_tokens
    vocab = target.get_input_embeddings().weight.shape[0]
    g = torch.Generator(device="cpu").manual_seed(1)
    input_ids = torch.randint(0, vocab, (1, prompt), generator=g).to(device)

    _cleanup(device)
    before = _allocated(device)
    params = [p for m in (target, drafter) for p in (*m.parameters(), *m.buffers())]
    weights_measured = sum(p.numel() * p.element_size() for p in params)
    t0 = time.perf_counter()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        res = speculative_generate(drafter, target, input_ids, max_new_tokens=new_tokens)
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device)
        method = "torch.cuda.max_memory_allocated"
    else:
        tracker = LiveBytes({p.untyped_storage().data_ptr() for p in params} | {input_ids.untyped_storage().data_ptr()})
        with tracker:
            res = speculative_generate(drafter, target, input_ids, max_new_tokens=new_tokens)
        peak = before + weights_measured + input_ids.numel() * 8 + tracker.peak
        method = "live tensor storage (dispatch mode) + weights"
    seconds = time.perf_counter() - t0
    generated = len(res.tokens)

    engine = "reference"
    # weights counted from the configs at bf16 (the dtype the models run in), not read from the files
    t_spec = resolve_target(read_config(t_src), "bf16", engine=engine)
    d_spec = resolve_drafter(read_config(d_src)).as_model("bf16")
    settings = BudgetSettings(gpu_name=str(device), gpu_bytes=gpu_bytes, context=prompt + generated,
                              concurrency=1, spec_tokens=(d_spec.shape.block_size or 16) - 1, engine=engine,
                              new_tokens=generated,
                              cublas_workspace_bytes=0 if device.type == "cpu" else DEFAULT_CUBLAS_WORKSPACE)  # fmt: skip
    b = compute_budget(t_spec, d_spec, settings, "bf16")
    phases = reference_phases(t_spec, d_spec, settings, settings.context)
    predicted = b.allocator_peak_bytes + input_ids.numel() * 8
    err = (predicted - peak) / peak
    row = {
        "case": name,
        "context": context,
        "prompt_tokens": prompt,
        "generated_tokens": generated,
        "steps": len(res.acceptance_lengths),
        "predicted_peak_bytes": predicted,
        "measured_peak_bytes": int(peak),
        "error": round(err, 4),
        "predicted_weights_bytes": t_spec.weight_bytes + d_spec.weight_bytes,
        "measured_weights_bytes": weights_measured,
        "allocated_before_run": before,
        "predicted_components": b.components,
        "predicted_phases": {k: sum(v.values()) for k, v in phases.items()},
        "peak_phase": max(phases, key=lambda k: sum(phases[k].values())),
        "method": method,
        "seconds": round(seconds, 2),
    }
    print(f"{name:10s} ctx {context:6d}  predicted {fmt_bytes(predicted):>11s}  measured {fmt_bytes(peak):>11s}"
          f"  error {100 * err:+.1f}%  ({row['peak_phase']}, {seconds:.1f}s)", flush=True)  # fmt: skip
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--cases", default="reference,qwen3-8b")
    ap.add_argument("--contexts", default="4096,16384,32768")
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--out", default=os.environ.get("OUT") or str(ROOT / "benchmarks" / "results"))
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    contexts = [int(c) for c in args.contexts.split(",") if c]
    gpu_bytes = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else 64 * GiB
    rows = []
    for case in [c.strip() for c in args.cases.split(",") if c.strip()]:
        if case == "reference":
            try:
                target, drafter, t_src, d_src = load_reference(device)
            except Exception as exc:  # absent pair or loader error: report and go on
                print(f"reference: skipped ({exc})", flush=True)
                rows.append({"case": "reference", "skipped": str(exc)})
                continue
        elif case in SHAPES:
            target, drafter, t_src, d_src = build_random(case, device)
        else:
            print(f"unknown case {case!r}; known: reference, {', '.join(SHAPES)}", file=sys.stderr)
            return 2
        max_pos = getattr(target.config, "max_position_embeddings", None) or max(contexts)
        case_contexts = sorted({min(c, max_pos) for c in contexts if min(c, max_pos) > args.new_tokens})
        for ctx in case_contexts:
            try:
                rows.append(run_case(case, target, drafter, t_src, d_src, ctx, args.new_tokens, device, gpu_bytes))
            except torch.cuda.OutOfMemoryError as exc:
                rows.append({"case": case, "context": ctx, "skipped": f"OOM: {exc}"})
        del target, drafter
        _cleanup(device)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "gpu_total_bytes": gpu_bytes,
        "new_tokens": args.new_tokens,
        "command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
    }
    (out / "memory_validation.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    lines = [
        f"# Predicted vs measured peak memory ({meta['device']}, torch {meta['torch']})",
        "",
        f"Command: `python benchmarks/{meta['command']}`; prediction: `dflash-quant budget --engine reference`"
        " model (weights counted from the config, bf16).",
        "",
        "| case | context | prompt | generated | predicted peak | measured peak | error | peak phase |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        if "skipped" in r:
            lines.append(
                f"| {r['case']} | {r.get('context', '-')} | - | - | - | - | - | skipped: {r['skipped'][:80]} |"
            )
            continue
        lines.append(
            f"| {r['case']} | {r['context']} | {r['prompt_tokens']} | {r['generated_tokens']} | "
            f"{fmt_bytes(r['predicted_peak_bytes'])} | {fmt_bytes(r['measured_peak_bytes'])} | "
            f"{100 * r['error']:+.1f}% | {r['peak_phase'].replace('_', ' ')} |"
        )
    (out / "memory_validation.md").write_text("\n".join(lines) + "\n")
    print(f"wrote {out / 'memory_validation.json'} and {out / 'memory_validation.md'}")
    bad = [r for r in rows if "error" in r and abs(r["error"]) > 0.10]
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
