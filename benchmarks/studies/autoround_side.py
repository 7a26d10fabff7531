"""AutoRound (Intel's auto-round) side by side with gptq-kl, fed the drafter's own calibration inputs.

auto-round tunes one transformer block at a time (signed-gradient updates of a rounding offset per weight and of
each group's min/max scale, against the block's bf16 output). Its block entry point (`AutoRound.quantize_block`,
the one llm-compressor drives) takes any nn.Module and a list of captured (args, kwargs) calls, so it can be fed
exactly what calibration records for a DFlash drafter: each prompt's recorded drafter forwards, packed into one
forward (`quantize.tune.pack`: context rows, then every block; a visibility mask per attention kind). Blocks, in
order: `fc` (on the raw target taps), then every decoder layer (block rows, with the context the quantized `fc`
makes, rotary tables, positions and the mask as keyword tensors; DFlash2's convolutions restart per block and their
kernel projections stay bf16, as in gptq-kl). Each layer is tuned on the quantized previous layers' outputs against
the bf16 ones, auto-round's own sequential scheme. Linears end on auto-round's grid (checked: every weight is
scale x (code - zero) with integer codes in range); the drafter is written with those weights (fp32) and measured
by `dflash-quant verify --compare` against the bf16 drafter on the same prompts as kl_tuning.py's splits.

auto-round imports `datasets` but needs nothing else outside this project's venv; it lives in its own venv:

    python3 -m venv /tmp/arvenv
    echo "$PWD/.venv/lib/python3.11/site-packages" > /tmp/arvenv/lib/python3.11/site-packages/zz_project.pth
    /tmp/arvenv/bin/pip install --no-deps auto-round==0.16.1 datasets pyarrow pandas dill multiprocess xxhash
    PYTHONPATH=$PWD /tmp/arvenv/bin/python benchmarks/studies/autoround_side.py --pair reference --bits 3 \
        --group-size 128 --calib 512 --split extra --out OUT.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from dflash_quant.calibration.capture import capture  # noqa: E402
from dflash_quant.io.atomic import write_json_atomic  # noqa: E402
from dflash_quant.loading.runtime import encode_prompts, load_pair, stop_tokens  # noqa: E402
from dflash_quant.quantize.tune import pack  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from kl_tuning import PAIRS, split_prompts  # noqa: E402


def prompt_files(pair: str, split: str, n_extra: int, work: Path) -> tuple[Path, Path]:
    """The calibration and evaluation prompt files of kl_tuning.py's split (same prompts, same order)."""
    lines, evals = split_prompts(pair, split, n_extra)
    if evals is None:  # heldout: the pair's own file
        evals = [x for x in (PAIRS[pair] / "heldout_prompts.jsonl").read_text().splitlines() if x.strip()]
    calib, ev = work / "calib.jsonl", work / "eval.jsonl"
    calib.write_text("\n".join(lines) + "\n")
    ev.write_text("\n".join(evals) + "\n")
    return calib, ev


class _Frozen(nn.Module):
    """A Linear auto-round must not see (DFlash2's convolution kernel projections stay bf16, as in gptq-kl)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.weight = linear.weight
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class _FcBlock(nn.Module):
    def __init__(self, fc: nn.Linear):
        super().__init__()
        self.fc = fc

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


def _autoround(block: nn.Module, bits: int, group: int, iters: int, samples: int, name: str):
    """An AutoRound instance set up to tune `block` alone (no model, tokenizer or dataset behind it)."""
    import transformers
    from auto_round import AutoRound

    class _Layers(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList([block])

    class _Wrapped(nn.Module):
        def __init__(self):
            super().__init__()
            self.model = _Layers()
            self.dtype = torch.float32
            self.config = transformers.PretrainedConfig(architectures=[name])
            self.name_or_path = ""  # a Hub-like name makes auto-round try a download

    ar = AutoRound(
        model=_Wrapped(), tokenizer="", bits=bits, group_size=group, sym=True, iters=iters, nsamples=samples,
        batch_size=1, gradient_accumulate_steps=8, enable_torch_compile=False, device_map="cpu", amp=False, seed=0,
    )  # fmt: skip
    ar.configure_layer_config(enable_gguf_official_mixed=False)
    ar.batch_dim = 0
    ar.post_init()
    ar.alg_composer.block_forward.batch_size = 1  # calls differ in length (0.16.1 keeps the default 8 here)
    return ar


def _on_grid(model: nn.Module, names: list[str], bits: int, group: int) -> dict[str, float]:
    """Per Linear the largest |W / scale + zero - round(.)|: 0 when every weight lies on auto-round's grid."""
    out = {}
    for n in names:
        m = model.get_submodule(n)
        w = m.weight.detach().float()
        scale = m.scale.float().repeat_interleave(group, dim=1)
        zp = torch.as_tensor(m.zp, dtype=torch.float32)
        codes = w / scale + zp
        err = float((codes - codes.round()).abs().max())
        lo, hi = float(codes.round().min()), float(codes.round().max())
        if lo < 0 or hi > 2**bits - 1:
            raise SystemExit(f"{n}: codes {lo}..{hi} outside the {bits}-bit grid")
        out[n] = err
    return out


def quantize(drafter, replay, bits: int, group: int, iters: int) -> dict:
    """auto-round on fc, then on each decoder layer in order; the drafter's Linears end fake-quantized in place."""
    model = drafter.model
    packs = [pack(model, calls) for calls in replay]
    seconds = {}
    t = time.perf_counter()
    with torch.enable_grad():
        fc_block = _FcBlock(model.fc)
        ar = _autoround(fc_block, bits, group, iters, len(packs), "DFlashFc")
        ar.quantize_block(block=fc_block, inputs=[(((p.ctx,), {}),) for p in packs], device="cpu", auto_offload=False)
    seconds["fc"] = round(time.perf_counter() - t, 1)
    with torch.no_grad():
        ctx = [model.hidden_norm(model.fc(p.ctx)) for p in packs]  # what the layers read: the quantized fc's context
        rot = [model.rotary_emb(p.noise, p.position_ids) for p in packs]
    fp_in = [p.noise for p in packs]
    q_in: list[torch.Tensor] | None = None
    for i, layer in enumerate(model.layers):
        if hasattr(layer, "conv_block"):
            layer.conv_block = packs[0].block  # the convolutions restart at every block, as the decode loop runs them
        frozen = {}
        for n, m in list(layer.named_modules()):
            if n.endswith("kernel_projection") and isinstance(m, nn.Linear):
                parent, _, leaf = n.rpartition(".")
                frozen[n] = (layer.get_submodule(parent), leaf, m)
                setattr(layer.get_submodule(parent), leaf, _Frozen(m))
        attn = layer.self_attn
        kw = [
            {
                "ctx": c, "cos": cs.to(c.dtype), "sin": sn.to(c.dtype), "positions": p.position_ids[0], "cache": None,
                "attention_mask": p.masks[(attn.is_causal, attn.sliding_window)],
            }
            for p, c, (cs, sn) in zip(packs, ctx, rot, strict=True)
        ]  # fmt: skip
        t = time.perf_counter()
        with torch.enable_grad():
            ar = _autoround(layer, bits, group, iters, len(packs), "DFlashLayer")
            q_out, ref_out = ar.quantize_block(
                block=layer, inputs=[(((h,), k),) for h, k in zip(fp_in, kw, strict=True)], q_input=q_in, device="cpu",
                auto_offload=False,
            )  # fmt: skip
        seconds[f"layer{i}"] = round(time.perf_counter() - t, 1)
        for parent, leaf, m in frozen.values():
            setattr(parent, leaf, m)
        fp_in = [r if r.dim() == 3 else r[None] for r in ref_out]
        q_in = [q if q.dim() == 3 else q[None] for q in q_out]
    return seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pair", choices=list(PAIRS), default="reference")
    ap.add_argument("--split", choices=("dev", "devfiles", "heldout", "extra"), default="dev")
    ap.add_argument("--bits", type=int, default=3)
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--calib", type=int, default=0, help="extra calibration prompts (as kl_tuning.py's calib=N)")
    ap.add_argument("--iters", type=int, default=200, help="auto-round's steps per block (its default)")
    ap.add_argument("--eval-new-tokens", type=int, default=128)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    import auto_round

    torch.manual_seed(0)
    torch.set_num_threads(1)
    result: dict = {
        "command": " ".join(sys.argv),
        "date": time.strftime("%Y-%m-%d"),
        "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip(),
        "auto_round": auto_round.__version__,
        "torch": torch.__version__,
        "pair": args.pair, "split": args.split, "bits": args.bits, "group_size": args.group_size,
        "calib_extra": args.calib, "iters": args.iters, "device": "cpu", "dtype": "float32",
    }  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        calib, evals = prompt_files(args.pair, args.split, args.calib, work)
        drafter, target = load_pair(args.pair, None, torch.device("cpu"), torch.float32)
        prompts = encode_prompts(target, str(calib), None, False, 64)
        t = time.perf_counter()
        stats = capture(
            drafter.model, target.model, prompts, 64, "block+context", stop_token_ids=stop_tokens(target),
            keep_replay=True, batch=16, teacher=True,
        )  # fmt: skip
        result["calibrate_s"] = round(time.perf_counter() - t, 1)
        result["calib_prompts"] = len(prompts)
        t = time.perf_counter()
        result["block_seconds"] = quantize(drafter, stats.replay, args.bits, args.group_size, args.iters)
        result["quantize_s"] = round(time.perf_counter() - t, 1)
        names = [n for n, m in drafter.model.named_modules() if hasattr(m, "scale") and isinstance(m, nn.Linear)]
        result["linears"] = names
        result["grid_error"] = _on_grid(drafter.model, names, args.bits, args.group_size)
        # the drafter as auto-round left it (fp32: scale x code is exact there, not in bf16), beside the bf16 one
        src = drafter.source.path
        out = work / "drafter-ar"
        shutil.copytree(src, out)
        from safetensors.torch import load_file, save_file

        tensors = load_file(str(src / "model.safetensors"))
        for n in names:  # only the Linears auto-round changed; every other tensor as shipped (its layout and dtype)
            if f"{n}.weight" not in tensors:
                raise SystemExit(f"{n}.weight is not a key of {src}/model.safetensors")
            tensors[f"{n}.weight"] = drafter.model.get_submodule(n).weight.detach().float().contiguous()
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
        cmd = [
            sys.executable, "-m", "dflash_quant.cli.app", "verify", str(out), "--target", f"{args.pair}:target",
            "--compare", args.pair, "--prompts", str(evals), "--max-new-tokens", str(args.eval_new_tokens),
            "--device", "cpu", "--dtype", "float32", "--json", "--no-check-cache", "--tolerance", "0.5",
        ]  # fmt: skip
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
        if proc.returncode not in (0, 1):
            raise SystemExit(f"verify failed:\n{proc.stderr[-2000:]}")
        result["verify"] = json.loads(proc.stdout)
        v = result["verify"]  # the auto-round drafter, measured against the bf16 one (--compare) on the same prompts
        result["tau"], result["tau_bf16"] = v["summary"]["tau"], v["baseline"]["tau"]
        result["tau_ratio"] = v["parity"]["tau_ratio"]
        result["per_position_acceptance"] = v["summary"]["per_position_acceptance"]
        result["lossless"] = v["summary"]["lossless"]
    write_json_atomic(Path(args.out), result)
    print(json.dumps({k: v for k, v in result.items() if k not in ("verify", "grid_error", "linears")}))


if __name__ == "__main__":
    main()
