"""The seed's scale on one GPU: a Qwen3.5-27B-shaped hybrid target and a Qwen3.8-27B-DFlash2-shaped drafter.

Builds random-weight models of the real shapes on the device (configs from dflash_quant/memory/presets; the
tokenizer is the reference pair's, whose ids all lie inside the 248k vocabulary), then runs the real CLI end to
end as a user would and measures each run:

  gpu     the target whole on cuda:0 (bf16)
  capped  the target spread by --device-map under the plan `budget --calibration --gpu 21.5GiB` prints
          (--hessian-device cpu --device-map auto --max-memory 0=...,cpu=...), with --gpu-memory-limit 21GiB: the
          whole process, GPTQ's solve and the CUDA context included, stays under the 22 GiB a 24 GB card leaves
  int4    a compressed-tensors W4A16 target (RTN, group 128) kept packed on cuda:0

Each run: `gptq --bits 4 --group-size 32 --teacher-forced` (16 calibration prompts x 64 tokens, parity check on
16 held-out prompts x 64 tokens, GPTQ v1 artifact, memory report and card), then `export` to compressed-tensors
and GGUF, then `memory`. Recorded: wall time by stage, the calibration's GPU peak (torch allocator) next to its
prediction, the whole command's GPU peak (nvidia-smi, CUDA context included) and host peak (max RSS).

  python3 benchmarks/hybrid27b/run.py --runs gpu,int4 --out $OUT         # on one H100/H200
  python3 benchmarks/hybrid27b/run.py --runs capped --out $OUT
  python3 benchmarks/hybrid27b/run.py --tiny --device cpu --runs gpu,int4 --out /tmp/h27   # plumbing, on CPU

Random weights draft badly (tau near 1): the run measures memory, time and that every stage works at this size,
not acceptance.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PRESETS = ROOT / "dflash_quant" / "memory" / "presets"
TOKENIZER = ROOT / "dflash_quant" / "reference" / "pair" / "target"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
PROMPT_TOKENS = 96  # the longest of the first 16 builtin calib / heldout prompts in this tokenizer is 94


def target_config(tiny: bool) -> dict:
    preset = json.loads((PRESETS / "qwen3.5-27b.json").read_text())
    tc = dict(preset["text_config"])
    for k in ("mtp_num_hidden_layers", "mtp_use_dedicated_embeddings"):
        tc.pop(k)
    if tiny:
        tc.update(
            hidden_size=256, intermediate_size=512, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
            head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=64,
            linear_value_head_dim=64, vocab_size=4096,
        )  # fmt: skip
    interval = tc.pop("full_attention_interval")
    n = tc["num_hidden_layers"]
    tc["layer_types"] = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n)]
    tc["rope_parameters"] = {"rope_theta": 10000000.0, "partial_rotary_factor": 0.25, "rope_type": "default"}
    tc.update(architectures=["Qwen3_5ForCausalLM"], bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return tc


def drafter_config(tiny: bool, target_layers: int) -> dict:
    raw = json.loads((PRESETS / "qwen3.8-27b-dflash2.json").read_text())
    raw = {k: v for k, v in raw.items() if not k.startswith("_")}
    raw["rope_theta"] = raw["rope_parameters"]["rope_theta"]  # flat copy: dflash-mlx reads it
    if tiny:
        raw.update(
            hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
            vocab_size=4096, num_target_layers=target_layers,
        )  # fmt: skip
        raw["dflash_config"] = {
            **raw["dflash_config"], "mask_token_id": 1, "target_layer_ids": [0, 2, 4, 5, 6], "selector_rank": 32,
            "conv_group_size": 16, "selector_top_k": 8,  # llama.cpp needs hidden >= top_k * (top_k + 1)
        }  # fmt: skip
    return raw


def pick_dirs(need_gb: float) -> list[Path]:
    """Folders with room for the target, most free space first (the device's /dev/shm is RAM, / is disk)."""
    seen, found = set(), []
    for p in (Path("/dev/shm"), Path("/tmp"), Path.home(), ROOT):
        if not p.is_dir() or not os.access(p, os.W_OK):
            continue
        st = os.statvfs(p)
        key = st.f_fsid
        if key in seen:
            continue
        seen.add(key)
        found.append((st.f_bavail * st.f_frsize / 1e9, p))
    found.sort(reverse=True)
    return [p for free, p in found if free >= need_gb] or [found[0][1]]


def build(work: Path, tiny: bool, device: str, int4: bool, log: dict, target_dir: str | None = None) -> dict[str, Path]:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    from dflash_quant.export.int4_target import write_packed
    from dflash_quant.models.config import parse_draft_config
    from dflash_quant.models.model2 import build_drafter
    from dflash_quant.quantize.spec import QuantSpec

    torch.manual_seed(0)
    tc = target_config(tiny)
    model_type = tc.pop("model_type")
    cfg = AutoConfig.for_model(model_type, **tc)
    t0 = time.perf_counter()
    with torch.device(device):
        target = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    target.eval()
    log["target_params"] = sum(p.numel() for p in target.parameters())
    log["target_bytes"] = sum(p.numel() * p.element_size() for p in target.parameters())
    dirs = [Path(target_dir)] if target_dir else pick_dirs(log["target_bytes"] / 1e9 + 2)
    paths = {"target": dirs[0] / "h27-target", "drafter": work / "drafter"}
    for p in paths.values():
        shutil.rmtree(p, ignore_errors=True)
    target.save_pretrained(paths["target"])
    for name in TOKENIZER_FILES:
        shutil.copyfile(TOKENIZER / name, paths["target"] / name)
    log["build_target_s"] = round(time.perf_counter() - t0, 1)
    log["target_dir"] = str(paths["target"])
    if int4:
        t0 = time.perf_counter()
        dst = (dirs[1] if len(dirs) > 1 else dirs[0]) / "h27-target-w4g128"
        shutil.rmtree(dst, ignore_errors=True)
        raw = json.loads((paths["target"] / "config.json").read_text())
        try:
            log["int4_counts"] = write_packed(
                dict(target.state_dict()), raw, paths["target"], dst, QuantSpec(4, 128, True)
            )
            paths["int4"] = dst
            log["int4_dir"] = str(dst)
        except Exception as exc:  # noqa: BLE001 - recorded; the bf16 runs go on
            log["int4_error"] = repr(exc)[:500]
        log["build_int4_s"] = round(time.perf_counter() - t0, 1)
    del target
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    t0 = time.perf_counter()
    raw = drafter_config(tiny, cfg.num_hidden_layers)
    with torch.device(device):
        drafter = build_drafter(parse_draft_config(raw)).to(torch.bfloat16)
    log["drafter_params"] = sum(p.numel() for p in drafter.parameters())
    paths["drafter"].mkdir(parents=True)
    save_file(
        {k: v.contiguous().cpu() for k, v in drafter.state_dict().items()}, str(paths["drafter"] / "model.safetensors")
    )
    (paths["drafter"] / "config.json").write_text(json.dumps(raw, indent=2))
    log["build_drafter_s"] = round(time.perf_counter() - t0, 1)
    del drafter
    return paths


class GpuPeak:
    """Highest memory.used nvidia-smi reports while a command runs (the whole device: CUDA contexts included)."""

    def __init__(self) -> None:
        self.peak_mib = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        while not self._stop.is_set():
            try:
                out = subprocess.run(
                    ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0"],
                    capture_output=True, text=True, timeout=5,
                )  # fmt: skip
                self.peak_mib = max(self.peak_mib, int(out.stdout.split()[0]))
            except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
                return
            self._stop.wait(0.25)

    def __enter__(self) -> GpuPeak:
        if shutil.which("nvidia-smi"):
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()


def _rss(pid: int, checkpoints: tuple[str, ...] = ()) -> dict[str, int]:
    """The process's resident memory by kind (bytes): anonymous (what it allocated), file-backed (mmapped
    checkpoint pages, which the kernel can drop) and shared memory (/dev/shm files it maps, and page-locked
    buffers). With `checkpoints` (model folders), also `Checkpoint`: the resident pages of files mapped from
    under them, and `Held`: every other resident page, which is what the process holds apart from the models'
    own files, the number `budget --calibration` predicts for a split target (offloaded layers + Hessians)."""
    out = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("VmRSS", "RssAnon", "RssFile", "RssShmem"):
                out[key] = int(value.split()[0]) * 1024
        if checkpoints:
            total = ckpt = 0
            inside = False
            for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
                head = line.split(None, 5)
                if (
                    head and "-" in head[0] and len(head) >= 5
                ):  # a mapping: address range, perms, offset, dev, inode[, path]
                    inside = len(head) == 6 and head[5].startswith(checkpoints)
                elif head and head[0] == "Rss:":
                    kb = int(head[1]) * 1024
                    total += kb
                    ckpt += kb if inside else 0
            out["Checkpoint"], out["Held"] = ckpt, total - ckpt
    except (OSError, ValueError, IndexError):
        pass
    return out


def cli(args: list[str], out: Path, name: str, timeout: int, checkpoints: tuple[str, ...] = ()) -> dict:
    """Run `dflash-quant ARGS` as a user would; wall time, exit code, host peaks (polled /proc) and GPU peak."""
    cmd = [sys.executable, "-m", "dflash_quant.cli.app", *args]
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "PYTHONPATH": path, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    t0 = time.perf_counter()
    host: dict[str, int] = {}
    with GpuPeak() as gpu, open(out / f"{name}.log", "w") as err, open(out / f"{name}.json", "wb") as stdout:
        proc = subprocess.Popen(cmd, stdout=stdout, stderr=err, env=env, cwd=ROOT)
        while proc.poll() is None:
            for key, value in _rss(proc.pid, checkpoints).items():
                host[key] = max(host.get(key, 0), value)
            if time.perf_counter() - t0 > timeout:
                proc.kill()
                proc.wait()
                break
            time.sleep(0.2)
        rc = 124 if proc.returncode in (-9, None) else proc.returncode
    row = {
        "command": "dflash-quant " + " ".join(args),
        "exit": rc,
        "seconds": round(time.perf_counter() - t0, 1),
        "host_peak_bytes": host,  # per kind, each its own maximum over the polls
        "gpu_peak_smi_bytes": gpu.peak_mib * 2**20 if gpu.peak_mib else None,
    }
    text = (out / f"{name}.json").read_bytes()
    try:
        row["result"] = json.loads(text)
    except ValueError:
        row["stdout_tail"] = text.decode(errors="replace")[-500:]
    return row


def budget_plan(target: Path, drafter: Path, gpu: str, out: Path, rows: int) -> dict:
    """`budget --calibration` for this run's calibration: the prediction and, where it does not fit, the plan."""
    row = cli(
        ["budget", "--calibration", "--target", str(target), "--drafter", str(drafter), "--gpu", gpu, "--json",
         "--prompt-tokens", str(PROMPT_TOKENS), "--teacher-forced", "--calib-batch", str(rows)],
        out, f"budget_{gpu}", 120,
    )  # fmt: skip
    return row.get("result") or {}


def summarize(name: str, gptq: dict) -> dict:
    r = gptq.get("result") or {}
    cal = r.get("calibration") or {}
    mem = cal.get("memory") or {}
    parity = r.get("parity") or {}
    return {
        "run": name,
        "exit": gptq["exit"],
        "seconds": gptq["seconds"],
        "timings": r.get("timings"),
        "calib_peak_measured_bytes": mem.get("measured_bytes"),
        "calib_peak_predicted_bytes": mem.get("predicted_peak_bytes"),
        "calib_peak_ratio": mem.get("ratio"),
        "gpu_peak_smi_bytes": gptq["gpu_peak_smi_bytes"],
        "host_peak_anon_bytes": gptq["host_peak_bytes"].get("RssAnon"),
        "host_peak_rss_bytes": gptq["host_peak_bytes"].get("VmRSS"),
        "host_peak_held_bytes": gptq["host_peak_bytes"].get("Held"),  # apart from the models' mapped files
        "calib_tau_bf16": cal.get("mean_tau_bf16"),
        "calib_cached": cal.get("cached"),
        "calib_resumed_prompts": cal.get("resumed_prompts"),
        "tau_bf16": (parity.get("baseline") or {}).get("tau"),
        "tau_int4": (parity.get("quantized") or {}).get("tau"),
        "tau_ratio": parity.get("tau_ratio"),
        "per_position_acceptance_int4": (parity.get("quantized") or {}).get("per_position_acceptance"),
        "passed": r.get("passed"),
    }


def reusable(work: Path, runs: list[str]) -> bool:
    """Whether an earlier build on this machine left every model these runs need (a warm machine keeps /tmp
    and /dev/shm between calls, and the build is the slowest step)."""
    try:
        built = json.loads((work / "build.json").read_text())
    except (OSError, ValueError):
        return False
    paths = built.get("paths", {})
    need = ["target", "drafter"] + (["int4"] if "int4" in runs and "int4_error" not in built.get("log", {}) else [])
    return all(k in paths and (Path(paths[k]) / "config.json").is_file() for k in need)


def fresh_build(work: Path, args: argparse.Namespace) -> dict | None:
    """Build in a child process, so that the runs' GPU peaks hold no CUDA context of ours."""
    (work / "build.json").unlink(missing_ok=True)
    child = [sys.executable, __file__, "--build-only", "--runs", args.runs, "--device", args.device]
    child += ["--target-dir", args.target_dir] if args.target_dir else []
    child += ["--tiny"] if args.tiny else []
    subprocess.run(child, env={**os.environ, "H27_WORK": str(work)}, check=False)
    if not (work / "build.json").is_file():
        return None
    return json.loads((work / "build.json").read_text())


# The capped run must stay under 22 GiB as nvidia-smi counts it (CUDA context included): the plan is made for a
# 21.5 GiB card (its 1 GiB reserve leaves 20.5 GiB to the allocations it predicts), and the allocator is capped at
# 21 GiB, so a misprediction of up to 0.5 GiB still runs and the process stays near 21.5 GiB with the context.
CAPPED_CARD = "21.5GiB"
CAPPED_LIMIT = "21GiB"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", default="gpu,int4", help="comma list of gpu, capped, int4")
    ap.add_argument("--tiny", action="store_true", help="small dims of the same structure (plumbing check on CPU)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--eval-new-tokens", type=int, default=64, help="tokens per parity prompt")
    ap.add_argument(
        "--capped-eval-new-tokens",
        type=int,
        default=32,
        help="tokens per parity prompt of the capped run (each offloaded step moves the CPU layers over PCIe)",
    )
    ap.add_argument("--timeout", type=int, default=560, help="seconds per gptq command (the device allows 600 a call)")
    ap.add_argument(
        "--deadline",
        type=int,
        default=570,
        help="seconds for the whole script: later steps are skipped when it runs out",
    )
    ap.add_argument("--build-only", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument(
        "--reuse-build",
        action="store_true",
        help="use the models an earlier run on this machine built (H27_WORK/build.json) when they are all there",
    )
    ap.add_argument("--target-dir", default=None, help="where the bf16 target is written (default: most free space)")
    ap.add_argument("--capped-memory", default=None, help="--max-memory of the capped run (default: budget's plan)")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "out/hybrid27b")))
    args = ap.parse_args()
    runs = [r.strip() for r in args.runs.split(",") if r.strip()]
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(os.environ.get("H27_WORK", "/tmp/h27"))
    work.mkdir(parents=True, exist_ok=True)
    result: dict = {"args": {k: str(v) for k, v in vars(args).items()}, "runs": {}}
    from importlib.metadata import version

    result["torch"], result["transformers"] = version("torch"), version("transformers")
    if shutil.which("nvidia-smi"):  # not through torch: this process keeps no CUDA context (the peaks are the runs')
        smi = ["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader", "-i", "0"]
        result["gpu"] = subprocess.run(smi, capture_output=True, text=True).stdout.strip()
    result["commit"] = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT
    ).stdout.strip()

    def save() -> None:
        (args.out / "hybrid27b.json").write_text(json.dumps(result, indent=1))

    t0 = time.perf_counter()
    deadline = t0 + args.deadline
    if args.build_only:
        log: dict = {}
        paths = build(work, args.tiny, args.device, "int4" in runs, log, args.target_dir)
        (work / "build.json").write_text(json.dumps({"log": log, "paths": {k: str(v) for k, v in paths.items()}}))
        return
    if args.reuse_build and reusable(work, runs):
        built = json.loads((work / "build.json").read_text())
        result["build"] = {**built["log"], "reused": True}
    else:
        built = fresh_build(work, args)
        if built is None:
            result["build"] = {"error": "the build process failed (see its output)"}
            save()
            raise SystemExit(1)
        result["build"] = {**built["log"], "seconds": round(time.perf_counter() - t0, 1)}
    paths = {k: Path(v) for k, v in built["paths"].items()}
    save()
    common = [
        "--bits", "4", "--group-size", "32", "--teacher-forced", "--num-prompts", str(args.prompts),
        "--max-new-tokens", str(args.new_tokens), "--eval-num-prompts", str(args.prompts),
        "--no-check-cache", "--json", "--device", args.device, "--tolerance", "0.5",
        "--calib-batch", str(args.prompts),  # the rows budget_plan prices; the teacher-forced check takes them too
    ]  # fmt: skip
    for name in runs:
        if name == "int4" and "int4" not in paths:
            result["runs"][name] = {"skipped": result["build"].get("int4_error", "no int4 target")}
            continue
        art = work / f"art-{name}"
        shutil.rmtree(art, ignore_errors=True)
        art.mkdir()
        target = paths["int4"] if name == "int4" else paths["target"]
        extra: list[str] = []
        plan_gpu = CAPPED_CARD if name == "capped" else ("h100" if not args.tiny else "24GB")
        plan = budget_plan(target, paths["drafter"], plan_gpu, args.out, args.prompts)
        row: dict = {"budget": {k: plan.get(k) for k in ("gpu", "peak_bytes", "fits", "fix", "predicted")}}
        if name == "capped":  # the flags `budget --calibration --gpu 21.5GiB` prints for this calibration
            row["plan_flags"] = (plan.get("fix") or {}).get("flags")
            if args.capped_memory:
                extra = ["--hessian-device", "cpu", "--device-map", "auto", "--max-memory", args.capped_memory]
            else:
                extra = " ".join(row["plan_flags"] or []).split()
            if args.device.startswith("cuda"):
                extra += ["--gpu-memory-limit", CAPPED_LIMIT]
        left = int(deadline - time.perf_counter())
        if left < 60:
            result["runs"][name] = {"skipped": f"{left} s left of --deadline"}
            continue
        # A calibration cache per run: a rerun on the warm machine (--reuse-build) resumes from its checkpoint.
        cache = work / f"calib-{name}"
        if not result["build"].get("reused"):
            shutil.rmtree(cache, ignore_errors=True)
        tokens = args.capped_eval_new_tokens if name == "capped" else args.eval_new_tokens
        extra += ["--calib-cache", str(cache), "--eval-max-new-tokens", str(tokens)]
        row["eval_max_new_tokens"] = tokens
        gptq = cli(["gptq", str(paths["drafter"]), "--target", str(target), *common, *extra, "-o", str(art / "gptq")],
                   args.out, f"gptq_{name}", min(args.timeout, left), (f"{target}/", f"{paths['drafter']}/"))  # fmt: skip
        row["gptq"] = {k: v for k, v in gptq.items() if k != "result"}
        row["summary"] = summarize(name, gptq)
        result["runs"][name] = row
        save()
        if gptq["exit"] != 0:
            continue
        for fmt in ("compressed-tensors", "gguf"):
            more = ["--target", str(paths["target"])] if fmt == "gguf" else []
            left = int(deadline - time.perf_counter())
            if left < 20:
                row[f"export_{fmt}"] = {"skipped": f"{left} s left of --deadline"}
                continue
            e = cli(["export", str(art / "gptq"), "--format", fmt, *more, "-o", str(art / fmt)], args.out,
                    f"export_{name}_{fmt}", min(300, left))  # fmt: skip
            row[f"export_{fmt}"] = {k: v for k, v in e.items() if k != "result"}
        m = cli(["memory", str(art / "gptq"), "--json"], args.out, f"memory_{name}", 60)
        row["memory"] = {k: v for k, v in m.items() if k != "result"}
        row["memory_report"] = m.get("result")
        row["card"] = (art / "gptq" / "README.md").is_file()
        save()
        shutil.rmtree(art, ignore_errors=True)
    print(json.dumps({n: r["summary"] for n, r in result["runs"].items()}, indent=1))


if __name__ == "__main__":
    main()
