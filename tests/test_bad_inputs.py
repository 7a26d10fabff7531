"""The bad-input table (issue #13): every bad input the CLI refuses, one row each.

Each row asserts the exit code, exactly one `error:` line on stderr matching the row's pattern, no traceback,
and that nothing was left behind: the row's scratch folder (where outputs would go) holds exactly the files it
held before, byte for byte (no output dir, no `.out.tmp-*`, no `.out.lock`, no memory.json or README written),
and the shared models and prompts are untouched. Most rows run in-process through typer's CliRunner; the signal
and concurrency rows run real subprocesses with the helpers of test_output_safety.py.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import signal
import struct
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from hub_fixtures import make_artifact
from test_output_safety import cmd as gptq_cmd
from tiny import drafter_raw_config, save_dflash2_drafter, save_drafter, save_target
from typer.testing import CliRunner

from dflash_quant.artifact.manifest import write_manifest
from dflash_quant.cli.app import app
from dflash_quant.io import atomic

LINE = "w1 w2 w3 w4 w5 w6 w7 w8"


@dataclass
class Ctx:
    """What a row builds its arguments from: the shared models (read-only) and a scratch folder of its own."""

    models: Path
    art: Path  # pristine GPTQ artifact (copied before a row changes it)
    tmp: Path
    exports: dict[str, Path] | None = None  # real exports of the reference pair, for the "exports" rows

    @property
    def d(self) -> str:
        return str(self.models / "drafter")

    @property
    def t(self) -> str:
        return str(self.models / "target")

    @property
    def p(self) -> str:
        return str(self.models / "prompts.txt")

    @property
    def out(self) -> str:
        return str(self.tmp / "out")

    def drafter(self, config=None, weights: bytes | None = None, **over) -> str:
        """A drafter dir in the scratch folder: the shared weights with a changed config (or raw JSON text)."""
        path = self.tmp / "bad-drafter"
        path.mkdir(exist_ok=True)
        (path / "model.safetensors").write_bytes(
            weights if weights is not None else (self.models / "drafter" / "model.safetensors").read_bytes()
        )
        text = (
            config
            if isinstance(config, str)
            else json.dumps(config if config is not None else {**drafter_raw_config(), **over})
        )
        (path / "config.json").write_text(text)
        return str(path)

    def target(self, config: str | None = None, **over) -> str:
        path = self.tmp / "bad-target"
        shutil.copytree(self.models / "target", path)
        if config is None:
            raw = json.loads((path / "config.json").read_text())
            raw.update(over)
            config = json.dumps(raw)
        (path / "config.json").write_text(config)
        return str(path)

    def file(self, name: str, data: bytes | str) -> str:
        path = self.tmp / name
        path.write_bytes(data.encode() if isinstance(data, str) else data)
        return str(path)

    def artifact(self) -> Path:
        path = self.tmp / "art"
        shutil.copytree(self.art, path)
        return path

    def export(self, fmt: str, change: Callable[[Path], None]) -> str:
        """A copy of a real `fmt` export changed by `change`, its manifest re-recorded (hash-consistent: only
        the format's own checks can catch it)."""
        assert self.exports is not None
        path = self.tmp / f"export-{fmt}"
        shutil.copytree(self.exports[fmt], path)
        change(path)
        write_manifest(path)
        return str(path)

    def verify(self, *extra: str, drafter: str | None = None, target: str | None = None) -> list[str]:
        return [
            "verify",
            drafter or self.d,
            "--target",
            target or self.t,
            "--prompts",
            self.p,
            "--max-new-tokens",
            "2",
            "--device",
            "cpu",
            *extra,
        ]

    def gptq(self, *extra: str, drafter: str | None = None, calib: str | None = None) -> list[str]:
        return [
            "gptq",
            drafter or self.d,
            "--target",
            self.t,
            "--calib-prompts",
            calib or self.p,
            "--eval-prompts",
            str(self.models / "eval.txt"),
            "--max-new-tokens",
            "2",
            "--eval-max-new-tokens",
            "2",
            "--group-size",
            "32",
            "--device",
            "cpu",
            "--no-card",
            "--output",
            self.out,
            *extra,
        ]

    def budget(self, *extra: str, drafter: str | None = None, target: str = "qwen3-8b") -> list[str]:
        return ["budget", "--target", target, "--drafter", drafter or self.d, *extra]


def header_claiming(ctx: Ctx, nbytes: int) -> bytes:
    """The shared drafter's safetensors with its first tensor's end offset moved to `nbytes`."""
    data = (ctx.models / "drafter" / "model.safetensors").read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    name = next(k for k in header if k != "__metadata__")
    header[name]["data_offsets"][1] = nbytes
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + data[8 + n :]


def with_manifest_entry(ctx: Ctx, name: str) -> str:
    art = ctx.artifact()
    manifest = json.loads((art / "manifest.json").read_text())
    manifest["files"][name] = {"sha256": "0" * 64, "bytes": 1}
    (art / "manifest.json").write_text(json.dumps(manifest))
    return str(art)


def with_provenance(ctx: Ctx, text: str) -> str:
    art = ctx.artifact()
    (art / "provenance.json").write_text(text)
    write_manifest(art)  # hash-consistent: only the shape check can catch it
    return str(art)


def previous_artifact(ctx: Ctx) -> str:
    out = Path(ctx.out)
    out.mkdir()
    (out / "config.json").write_text("{}")
    write_manifest(out)
    return ctx.out


def user_dir(ctx: Ctx) -> str:
    Path(ctx.out).mkdir()
    (Path(ctx.out) / "paper.tex").write_text("years of work")
    return ctx.out


# --- subprocess rows: signals and concurrency (helpers shared with test_output_safety.py) ---------------------


def _proc_cmd(ctx: Ctx, *extra: str) -> list[str]:
    return gptq_cmd(ctx.models, ctx.out, *extra)


def signalled(sig: int):
    def run(ctx: Ctx) -> subprocess.CompletedProcess:
        proc = subprocess.Popen(_proc_cmd(ctx), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.time() + 60
        while proc.poll() is None and not (ctx.tmp / ".out.lock").exists() and time.time() < deadline:
            time.sleep(0.01)
        assert proc.poll() is None, "the run ended before the signal"
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=120)
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)

    return run


def locked(ctx: Ctx) -> subprocess.CompletedProcess:
    with atomic.guard_output(Path(ctx.out), overwrite=False):
        res = subprocess.run(_proc_cmd(ctx), capture_output=True, text=True, timeout=120)
        assert (ctx.tmp / ".out.lock").is_file()  # the refused run left our lock alone
    return res


@dataclass(frozen=True)
class Row:
    id: str
    group: str
    build: Callable[[Ctx], list[str] | subprocess.CompletedProcess]
    code: int
    pattern: str


R = Row
ROWS = [
    # --- models: drafter config ------------------------------------------------------------------------------
    R(
        "layers-word",
        "models",
        lambda c: ["inspect", c.drafter(num_hidden_layers="three")],
        1,
        r"num_hidden_layers is 'three' \(str\).*integer",
    ),
    R("hidden-string", "models", lambda c: ["inspect", c.drafter(hidden_size="64")], 1, r"hidden_size is '64' \(str\)"),
    R(
        "layers-bool",
        "models",
        lambda c: ["inspect", c.drafter(num_hidden_layers=True)],
        1,
        r"num_hidden_layers is True \(bool\)",
    ),
    R(
        "layers-float",
        "models",
        lambda c: ["inspect", c.drafter(num_hidden_layers=2.0)],
        1,
        r"num_hidden_layers is 2\.0 \(float\)",
    ),
    R(
        "zero-heads",
        "models",
        lambda c: ["inspect", c.drafter(num_attention_heads=0)],
        1,
        r"num_attention_heads is 0; it must be >= 1",
    ),
    R(
        "zero-kv-heads",
        "models",
        lambda c: ["inspect", c.drafter(num_key_value_heads=0)],
        1,
        r"num_key_value_heads is 0",
    ),
    R(
        "heads-not-multiple-of-kv",
        "models",
        lambda c: ["inspect", c.drafter(num_key_value_heads=3)],
        1,
        r"num_attention_heads 4 is not a multiple of num_key_value_heads 3",
    ),
    R("negative-head-dim", "models", lambda c: ["inspect", c.drafter(head_dim=-16)], 1, r"head_dim is -16"),
    R(
        "zero-intermediate",
        "models",
        lambda c: ["inspect", c.drafter(intermediate_size=0)],
        1,
        r"intermediate_size is 0",
    ),
    R("zero-vocab", "models", lambda c: ["inspect", c.drafter(vocab_size=0)], 1, r"vocab_size is 0"),
    R("block-size-0", "models", lambda c: ["inspect", c.drafter(block_size=0)], 1, r"block_size is 0; it must be >= 2"),
    R("block-size-1", "models", lambda c: ["inspect", c.drafter(block_size=1)], 1, r"block_size is 1; it must be >= 2"),
    R(
        "block-size-string",
        "models",
        lambda c: ["inspect", c.drafter(block_size="16")],
        1,
        r"block_size is '16' \(str\)",
    ),
    R(
        "mask-token-negative",
        "models",
        lambda c: ["inspect", c.drafter(dflash_config={"mask_token_id": -1, "target_layer_ids": [0, 2]})],
        1,
        r"mask_token_id is -1",
    ),
    R(
        "taps-not-ints",
        "models",
        lambda c: ["inspect", c.drafter(dflash_config={"mask_token_id": 2, "target_layer_ids": ["a"]})],
        1,
        r"target_layer_ids is \['a'\]",
    ),
    R(
        "config-json-list",
        "models",
        lambda c: ["inspect", c.drafter(config="[1, 2]")],
        1,
        r"config\.json holds a JSON list, not an object",
    ),
    R(
        "config-not-json",
        "models",
        lambda c: ["inspect", c.drafter(config="{not json")],
        1,
        r"config\.json is not valid JSON",
    ),
    R(
        "config-not-utf8",
        "models",
        lambda c: ["inspect", _binary_config(c)],
        1,
        r"config\.json is not UTF-8 text \(byte 1\)",
    ),
    R(
        "target-as-drafter",
        "models",
        lambda c: ["inspect", c.t],
        1,
        r"not a DFlash drafter config.*pass the drafter directory",
    ),
    R(
        "billion-layers",
        "models",
        lambda c: ["inspect", c.drafter(num_hidden_layers=10**9)],
        1,
        r"num_hidden_layers 1000000000 but the weights hold 2 layers",
    ),
    R(
        "billion-layers-verify",
        "models",
        lambda c: c.verify(drafter=c.drafter(num_hidden_layers=10**9)),
        1,
        r"num_hidden_layers 1000000000 but the weights hold 2 layers",
    ),
    R(
        "layers-more-than-weights",
        "models",
        lambda c: ["inspect", c.drafter(num_hidden_layers=3)],
        1,
        r"num_hidden_layers 3 but the weights hold 2",
    ),
    R(
        "hidden-vs-fc-shape",
        "models",
        lambda c: ["inspect", c.drafter(hidden_size=32, head_dim=8)],
        1,
        r"fc\.weight is \[64, 128\] but config\.json implies \[32, 64\]",
    ),
    R(
        "heads-vs-q-shape",
        "models",
        lambda c: ["inspect", c.drafter(num_attention_heads=8, num_key_value_heads=4)],
        1,
        r"q_proj\.weight is \[64, 64\] but config\.json implies \[128, 64\]",
    ),
    R(
        "dflash2-conv-group-0",
        "models",
        lambda c: ["inspect", _dflash2(c, conv_group_size=0)],
        1,
        r"conv_group_size is 0; it must be a positive integer",
    ),
    R("no-config", "models", lambda c: ["inspect", str(c.tmp)], 1, r"config\.json not found"),
    R(
        "pickle-only",
        "models",
        lambda c: ["inspect", _pickle_only(c)],
        1,
        r"only pickle checkpoints.*convert them to safetensors",
    ),
    R(
        "header-claims-terabytes",
        "models",
        lambda c: ["inspect", c.drafter(weights=header_claiming(c, 2**42))],
        1,
        r"model\.safetensors is truncated or corrupt .*re-download",
    ),
    R(
        "truncated-weights",
        "models",
        lambda c: c.verify(drafter=c.drafter(weights=(c.models / "drafter" / "model.safetensors").read_bytes()[:5000])),
        1,
        r"truncated or corrupt",
    ),
    R(
        "weights-4-bytes",
        "models",
        lambda c: ["inspect", c.drafter(weights=b"\x01\x02\x03\x04")],
        1,
        r"truncated or corrupt \(file shorter than 8 bytes\)",
    ),
    R(
        "target-zero-heads",
        "models",
        lambda c: c.verify(target=c.target(num_attention_heads=0)),
        1,
        r"bad-target/config\.json: num_attention_heads is 0",
    ),
    R(
        "target-config-list",
        "models",
        lambda c: c.verify(target=c.target(config="[]")),
        1,
        r"bad-target/config\.json holds a JSON list",
    ),
    R(
        "target-billion-layers",
        "models",
        lambda c: c.verify(target=c.target(num_hidden_layers=10**9)),
        1,
        r"num_hidden_layers 1000000000 but the weights hold 4 layers",
    ),
    R("drafter-as-target", "models", lambda c: c.verify(target=c.d), 1, r"is a DFlash drafter, not a target"),
    R(
        "target-gptq-no-backend",
        "models",
        lambda c: c.verify(target=c.target(quantization_config={"quant_method": "gptq", "bits": 4, "group_size": 128})),
        2,
        r"GPTQ checkpoint and its backend \(GPTQModel\) is not installed; pip install 'dflash-quant\[gptq-target\]'",
    ),
    R(
        "target-ct-not-packed",
        "models",
        lambda c: c.verify(
            target=c.target(quantization_config={"quant_method": "compressed-tensors", "format": "float-quantized"})
        ),
        2,
        r"compressed-tensors format 'float-quantized' cannot be kept packed",
    ),
    R(
        "target-quant-method-unknown",
        "models",
        lambda c: c.verify(target=c.target(quantization_config={"quant_method": "bitsandbytes"})),
        2,
        r"target quant_method 'bitsandbytes' is not supported",
    ),
    R(
        "target-quantized-device-map",
        "models",
        lambda c: c.verify(
            "--device-map", "auto", target=c.target(quantization_config={"quant_method": "compressed-tensors"})
        ),
        2,
        r"is quantized \(compressed-tensors\) and is loaded packed on one device; drop --device-map",
    ),
    R(
        "hub-id-malformed",
        "models",
        lambda c: ["inspect", "not//a repo"],
        1,
        r"neither an existing directory nor a Hub repo id",
    ),
    R(
        "hub-id-not-cached",
        "models",
        lambda c: ["inspect", "nobody-xyz/no-such-drafter"],
        1,
        r"cannot fetch nobody-xyz/no-such-drafter.*HF_HUB_OFFLINE",
    ),
    # --- arguments -------------------------------------------------------------------------------------------
    R(
        "temperature-inf",
        "arguments",
        lambda c: c.verify("--temperature", "inf"),
        2,
        r"--temperature must be a finite number >= 0 \(got inf\)",
    ),
    R(
        "temperature-nan",
        "arguments",
        lambda c: c.verify("--temperature", "nan"),
        2,
        r"--temperature must be a finite number >= 0 \(got nan\)",
    ),
    R(
        "lookup-max-tokens-0",
        "arguments",
        lambda c: c.verify("--lookup", "--lookup-max-tokens", "0"),
        2,
        r"lookup max tokens must be at least 1, got 0",
    ),
    R(
        "lookup-both-row-shorter-than-block",
        "arguments",
        lambda c: c.verify("--lookup", "--lookup-max-tokens", "2"),
        2,
        r"--lookup-max-tokens 2 is shorter than the drafter's block \(3 drafts\).*use >= 3",
    ),
    R(
        "gptq-lookup-max-tokens-0",
        "arguments",
        lambda c: c.gptq("--lookup", "--lookup-max-tokens", "0"),
        2,
        r"lookup max tokens must be at least 1, got 0",
    ),
    R(
        "gptq-lookup-both-row-shorter-than-block",
        "arguments",
        lambda c: c.gptq("--lookup", "--lookup-max-tokens", "1"),
        2,
        r"--lookup-max-tokens 1 is shorter than the drafter's block \(3 drafts\)",
    ),
    R("temperature-negative", "arguments", lambda c: c.verify("--temperature", "-1"), 2, r"--temperature .*got -1"),
    R(
        "int4-kernel-unknown-verify",
        "arguments",
        lambda c: c.verify("--int4-kernel", "marlin"),
        2,
        r"--int4-kernel must be one of auto, dequant, cuda, triton, tinygemm, gemlite, got 'marlin'",
    ),
    R(
        "int4-kernel-unknown-gptq",
        "arguments",
        lambda c: c.gptq("--int4-kernel", "marlin"),
        2,
        r"--int4-kernel must be one of auto, dequant, cuda, triton, tinygemm, gemlite, got 'marlin'",
    ),
    R(
        "max-new-tokens-0",
        "arguments",
        lambda c: c.verify("--max-new-tokens", "0"),
        2,
        r"'--max-new-tokens'.*greater than or equal to 1.*--help",
    ),
    R("block-size-arg-1", "arguments", lambda c: c.verify("--block-size", "1"), 2, r"--block-size 1 is too small"),
    R(
        "block-size-arg-too-big",
        "arguments",
        lambda c: c.verify("--block-size", "99"),
        2,
        r"--block-size 99 must be between 2 and the drafter's block size 4",
    ),
    R(
        "num-prompts-0",
        "arguments",
        lambda c: c.verify("--num-prompts", "0"),
        2,
        r"--num-prompts must be at least 1 \(got 0\)",
    ),
    R("verify-tolerance-1", "arguments", lambda c: c.verify("--tolerance", "1"), 2, r"--tolerance must be in \[0, 1\)"),
    R(
        "device-cuda-without-cuda",
        "arguments",
        lambda c: c.verify("--device", "cuda"),
        2,
        r"no CUDA device is available; use --device cpu",
    ),
    R("unknown-dtype", "arguments", lambda c: c.verify("--dtype", "int3"), 2, r"unknown dtype 'int3'"),
    R("unknown-option", "arguments", lambda c: c.verify("--bogus"), 2, r"No such option: --bogus"),
    R("missing-drafter", "arguments", lambda c: ["verify"], 2, r"Missing argument"),
    R("gptq-bits-5", "arguments", lambda c: c.gptq("--bits", "5"), 2, r"bits=5 is not supported"),
    R("gptq-bits-word", "arguments", lambda c: c.gptq("--bits", "four"), 2, r"'--bits'.*valid integer"),
    R("gptq-group-size-0", "arguments", lambda c: c.gptq("--group-size", "0"), 2, r"group_size=0 is invalid"),
    R(
        "gptq-num-prompts-0",
        "arguments",
        lambda c: c.gptq("--num-prompts", "0"),
        2,
        r"--num-prompts must be at least 1",
    ),
    R(
        "gptq-eval-num-prompts-0",
        "arguments",
        lambda c: c.gptq("--eval-num-prompts", "0"),
        2,
        r"--eval-num-prompts must be at least 1",
    ),
    R(
        "gptq-check-batch-0",
        "arguments",
        lambda c: c.gptq("--check-batch", "0"),
        2,
        r"--check-batch must be at least 1",
    ),
    R(
        "gptq-calib-batch-0",
        "arguments",
        lambda c: c.gptq("--calib-batch", "0"),
        2,
        r"--calib-batch must be at least 1",
    ),
    R("gptq-tolerance-1", "arguments", lambda c: c.gptq("--tolerance", "1.0"), 2, r"--tolerance must be in \[0, 1\)"),
    R(
        "gptq-tolerance-negative",
        "arguments",
        lambda c: c.gptq("--tolerance", "-0.1"),
        2,
        r"--tolerance must be in \[0, 1\)",
    ),
    R(
        "gptq-method",
        "arguments",
        lambda c: c.gptq("--method", "awq"),
        2,
        r"--method must be one of gptq, gptq-kl, rtn",
    ),
    R(
        "gptq-teacher-with-lookup",
        "arguments",
        lambda c: c.gptq("--teacher-forced", "--lookup"),
        2,
        r"drop --teacher-forced or --lookup",
    ),
    R(
        "verify-teacher-with-lookup",
        "arguments",
        lambda c: c.verify("--teacher-forced", "--lookup"),
        2,
        r"--teacher-forced replays the target's greedy continuation; drop --lookup",
    ),
    R(
        "gptq-teacher-with-full-baseline",
        "arguments",
        lambda c: c.gptq("--teacher-forced", "--full-baseline"),
        2,
        r"drop --teacher-forced or --full-baseline",
    ),
    R(
        "gptq-gguf-type-unknown",
        "arguments",
        lambda c: c.gptq("--format", "gguf", "--gguf-type", "Q7_K"),
        2,
        r"--gguf-type 'Q7_K' is not supported; use a pure type .* or a llama.cpp mix \(Q2_K_MIX",
    ),
    R(
        "gptq-gguf-scale-search-range",
        "arguments",
        lambda c: c.gptq("--format", "gguf", "--gguf-type", "Q3_K_S", "--gguf-scale-search", "9"),
        2,
        r"--gguf-scale-search must be 0\.\.8 \(0: off\), got 9",
    ),
    R(
        "gptq-gguf-taps-last-layer",
        "models",
        lambda c: c.gptq(
            "--format",
            "gguf",
            "--gguf-type",
            "IQ4_NL",
            drafter=c.drafter(dflash_config={"mask_token_id": 2, "target_layer_ids": [0, 3]}),
        ),
        2,
        r"taps target layer 3, the last of 4: llama.cpp reads layer inputs .* llama-server would abort",
    ),
    R(
        "gptq-gguf-type-clip-search",
        "arguments",
        lambda c: c.gptq("--format", "gguf", "--gguf-type", "Q3_K_S", "--clip-search"),
        2,
        r"--clip-search is for GPTQ v1 grids; with --gguf-type Q3_K_S use --gguf-scale-search",
    ),
    R("gptq-damp-0", "arguments", lambda c: c.gptq("--damp", "0"), 2, r"--damp must be in \(0, 1\)"),
    R(
        "gptq-skip-regex",
        "arguments",
        lambda c: c.gptq("--skip", "("),
        2,
        r"--skip '\(' is not a valid regular expression",
    ),
    R(
        "gptq-kv-hessian",
        "arguments",
        lambda c: c.gptq("--kv-hessian", "context"),
        2,
        r"--kv-hessian must be one of block, block\+context",
    ),
    R("gptq-device-cuda", "arguments", lambda c: c.gptq("--device", "cuda"), 2, r"no CUDA device is available"),
    R("gptq-dtype", "arguments", lambda c: c.gptq("--dtype", "int3"), 2, r"unknown dtype 'int3'"),
    R(
        "memory-out-is-dir",
        "arguments",
        lambda c: ["memory", c.d, "--device", "none", "--out", str(c.tmp)],
        2,
        r"--out .* is a directory; pass a file path",
    ),
    R(
        "memory-out-no-parent",
        "arguments",
        lambda c: ["memory", c.d, "--device", "none", "--out", str(c.tmp / "no" / "m.json")],
        2,
        r"does not exist; create it",
    ),
    R(
        "memory-out-drafter-weights",
        "arguments",
        lambda c: ["memory", c.d, "--device", "none", "--out", str(Path(c.d) / "model.safetensors")],
        2,
        r"--out \S+model\.safetensors lies inside the input",
    ),
    R(
        "memory-out-in-baseline",
        "arguments",
        lambda c: ["memory", str(c.artifact()), "--baseline", c.d, "--device", "none", "--out", c.d + "/config.json"],
        2,
        r"--out \S+config\.json lies inside the input",
    ),
    R(
        "memory-out-foreign-file",
        "arguments",
        lambda c: ["memory", c.d, "--device", "none", "--out", c.file("notes.json", '{"mine": 1}')],
        2,
        r"--out \S+notes\.json exists and is not a memory report",
    ),
    R(
        "imatrix-output-in-drafter",
        "arguments",
        lambda c: ["imatrix", c.d, "--target", c.t, "-o", c.d + "/model.safetensors", "--overwrite"],
        2,
        r"--output \S+model\.safetensors lies inside the input",
    ),
    R(
        "imatrix-output-is-prompts",
        "arguments",
        lambda c: ["imatrix", c.d, "--target", c.t, "--calib-prompts", c.p, "-o", c.p, "--overwrite"],
        2,
        r"--output \S+prompts\.txt is the input",
    ),
    R(
        "memory-device",
        "arguments",
        lambda c: ["memory", c.d, "--device", "tpu", "--no-write"],
        2,
        r"unknown --device 'tpu'",
    ),
    R(
        "memory-not-a-dir",
        "arguments",
        lambda c: ["memory", c.p, "--no-write"],
        1,
        r"is not a directory; pass the artifact directory",
    ),
    # --- prompts ---------------------------------------------------------------------------------------------
    R(
        "prompt-binary",
        "prompts",
        lambda c: c.verify("--prompts", c.file("p.txt", b"w1 w2\n\x00\x01\x02")),
        2,
        r"p\.txt is binary \(NUL at byte 6\)",
    ),
    R(
        "prompt-latin1",
        "prompts",
        lambda c: c.verify("--prompts", c.file("p.txt", "w1 caf\xe9\n".encode("latin-1"))),
        2,
        r"p\.txt is not UTF-8 text \(byte 6: b'\\xe9'\)",
    ),
    R(
        "prompt-jsonl-not-utf8",
        "prompts",
        lambda c: c.verify("--prompts", c.file("p.jsonl", b'{"prompt": "\xff"}\n')),
        2,
        r"p\.jsonl is not UTF-8 text \(byte 12",
    ),
    R(
        "prompt-empty",
        "prompts",
        lambda c: c.verify("--prompts", c.file("p.txt", "")),
        2,
        r"prompt set .*p\.txt' is empty",
    ),
    R(
        "prompt-blank-lines",
        "prompts",
        lambda c: c.verify("--prompts", c.file("p.txt", "\n  \n\n")),
        2,
        r"is empty; add prompts",
    ),
    R(
        "prompt-jsonl-bad-json",
        "prompts",
        lambda c: c.verify("--prompts", c.file("p.jsonl", "{nope\n")),
        2,
        r"p\.jsonl, line 1: not valid JSON",
    ),
    R(
        "prompt-jsonl-list",
        "prompts",
        lambda c: c.verify("--prompts", c.file("p.jsonl", "[1]\n")),
        2,
        r"line 1: expected a JSON object",
    ),
    R(
        "prompt-jsonl-empty-prompt",
        "prompts",
        lambda c: c.verify("--prompts", c.file("p.jsonl", '{"prompt": ""}\n')),
        2,
        r"`prompt` must be a non-empty string",
    ),
    R(
        "prompt-suffix",
        "prompts",
        lambda c: c.verify("--prompts", c.file("p.csv", LINE)),
        2,
        r"unknown prompt file type '\.csv'",
    ),
    R(
        "prompt-missing",
        "prompts",
        lambda c: c.verify("--prompts", str(c.tmp / "none.txt")),
        2,
        r"neither builtin.*nor an existing",
    ),
    R(
        "prompt-directory",
        "prompts",
        lambda c: c.verify("--prompts", str(c.tmp)),
        2,
        r"is a directory; pass a \.txt or \.jsonl",
    ),
    R("prompt-split", "prompts", lambda c: c.verify("--prompts", "builtin:train"), 2, r"unknown split 'train'"),
    R(
        "prompt-too-long",
        "prompts",
        lambda c: c.verify("--prompts", c.file("p.txt", " ".join(["w5"] * 600))),
        2,
        r"prompt 1 of .* is 600 tokens; with --max-new-tokens 2 it needs 602 positions but the target has 512",
    ),
    R(
        "prompt-plus-new-tokens-too-long",
        "prompts",
        lambda c: c.verify(
            "--prompts", c.file("p.txt", LINE + "\n" + " ".join(["w5"] * 500)), "--max-new-tokens", "20"
        ),
        2,
        r"prompt 2 of .* is 500 tokens; with --max-new-tokens 20 it needs 520",
    ),
    R(
        "gptq-calib-binary",
        "prompts",
        lambda c: c.gptq(calib=c.file("calib.txt", b"\x89PNG\r\n\x1a\n\x00")),
        2,
        r"calib\.txt is not UTF-8 text \(byte 0",
    ),
    R(
        "gptq-calib-too-long",
        "prompts",
        lambda c: c.gptq(calib=c.file("calib.txt", " ".join(["w7"] * 511))),
        2,
        r"prompt 1 of .* is 511 tokens; with --max-new-tokens 2",
    ),
    R(
        "gptq-eval-too-long",
        "prompts",
        lambda c: c.gptq("--eval-prompts", c.file("e.txt", " ".join(["w7"] * 511))),
        2,
        r"with --eval-max-new-tokens 2 it needs 513 positions",
    ),
    # --- artifacts and push -------------------------------------------------------------------------------
    R(
        "card-absolute-path-in-manifest",
        "artifacts",
        lambda c: ["card", with_manifest_entry(c, "/etc/passwd")],
        1,
        r"absolute path",
    ),
    R(
        "card-dotdot-in-manifest",
        "artifacts",
        lambda c: ["card", with_manifest_entry(c, "../outside.txt")],
        1,
        r"'\.\.' part",
    ),
    R(
        "card-malformed-provenance",
        "artifacts",
        lambda c: ["card", with_provenance(c, "{not json")],
        1,
        r"provenance\.json",
    ),
    R("card-provenance-list", "artifacts", lambda c: ["card", with_provenance(c, "[]")], 1, r"provenance\.json"),
    R("card-not-a-dir", "artifacts", lambda c: ["card", c.p], 2, r"is not a directory"),
    # --- exports: GGUF, MLX, compressed-tensors written by `export`, then damaged -------------------------------
    R(
        "gguf-tensors-not-config",
        "exports",
        lambda c: ["inspect", c.export("gguf", lambda p: _edit_config(p, intermediate_size=1024))],
        1,
        r"mlp\.gate_proj\.weight is \[512, 256\] but config\.json implies \[1024, 256\]",
    ),
    R(
        "gguf-truncated",
        "exports",
        lambda c: ["memory", c.export("gguf", _truncate_gguf), "--device", "none"],
        1,
        r"drafter-Q4_0\.gguf is not a readable GGUF file .*; re-export it",
    ),
    R(
        "mlx-no-quantization-key",
        "exports",
        lambda c: ["verify", c.export("mlx", lambda p: _edit_config(p, quantization=None)), "--device", "cpu"],
        1,
        r"stored MLX-packed .* config\.json has no `quantization` key",
    ),
    R(
        "compressed-tensors-unknown-scheme",
        "exports",
        lambda c: ["memory", c.export("compressed-tensors", lambda p: _ct_weights(p, type="float")), "--device", "cpu"],
        1,
        r"config group 'group_0' has weight type 'float'; .*re-export",
    ),
    R(
        "compressed-tensors-unreadable-bits",
        "exports",
        lambda c: ["verify", c.export("compressed-tensors", lambda p: _ct_weights(p, num_bits=5)), "--device", "cpu"],
        1,
        r"has num_bits 5 \(readable: 2, 3, 4, 8\)",
    ),
    R(
        "memory-tampered-weights",
        "artifacts",
        lambda c: ["memory", _tampered(c), "--device", "none"],
        1,
        r"model\.safetensors does not match its sha256",
    ),
    R(
        "push-absolute-path",
        "push",
        lambda c: ["push", with_manifest_entry(c, "/etc/passwd"), "--repo-id", "org/name", "--dry-run"],
        1,
        r"absolute path",
    ),
    R(
        "push-malformed-provenance",
        "push",
        lambda c: ["push", with_provenance(c, json.dumps({"command": "gptq"})), "--repo-id", "org/name", "--dry-run"],
        1,
        r"provenance\.json",
    ),
    R(
        "push-bad-repo-id",
        "push",
        lambda c: ["push", str(c.artifact()), "--repo-id", "no-slash", "--dry-run"],
        2,
        r"--repo-id must be ORG/NAME",
    ),
    R("push-missing-artifact", "push", lambda c: ["push", str(c.tmp / "none"), "--repo-id", "org/name"], 1, r"none"),
    # --- output safety (gptq) and concurrency ----------------------------------------------------------------
    R(
        "output-is-the-drafter",
        "output",
        lambda c: c.gptq("--output", c.d, "--overwrite"),
        2,
        r"--output .* is the input",
    ),
    R(
        "output-inside-the-drafter",
        "output",
        lambda c: c.gptq("--output", str(Path(c.d) / "q")),
        2,
        r"lies inside the input",
    ),
    R(
        "output-is-a-user-dir",
        "output",
        lambda c: c.gptq("--output", user_dir(c), "--overwrite"),
        2,
        r"not a dflash-quant artifact",
    ),
    R("output-is-a-file", "output", lambda c: c.gptq("--output", c.file("out", "x")), 2, r"not a directory"),
    R(
        "output-previous-artifact",
        "output",
        lambda c: c.gptq("--output", previous_artifact(c)),
        2,
        r"already exists.*--overwrite",
    ),
    R(
        "output-unwritable",
        "output",
        lambda c: c.gptq("--output", "/proc/dflash-quant-test/out"),
        2,
        r"writable --output",
    ),
    R(
        "calib-cache-is-a-file",
        "output",
        lambda c: c.gptq("--calib-cache", c.file("cache", "x")),
        2,
        r"--calib-cache.*not a directory",
    ),
    R(
        "calib-cache-max-gb-negative",
        "arguments",
        lambda c: c.gptq("--calib-cache-max-gb", "-1"),
        2,
        r"'--calib-cache-max-gb'.*greater than or equal to 0.*--help",
    ),
    R(
        "foreign-lock-file",
        "concurrency",
        lambda c: c.gptq() if c.file(".out.lock", "my notes\n") else [],
        2,
        r"\.out\.lock exists and is not a dflash-quant lock",
    ),
    R("output-locked-subprocess", "concurrency", locked, 2, r"another dflash-quant run .*pid "),
    R("sighup-while-loading", "signals", signalled(signal.SIGHUP), 128 + signal.SIGHUP, r"stopped by SIGHUP"),
    R("sigterm-while-loading", "signals", signalled(signal.SIGTERM), 128 + signal.SIGTERM, r"stopped by SIGTERM"),
    # --- budget ----------------------------------------------------------------------------------------------
    R(
        "budget-zero-heads",
        "budget",
        lambda c: c.budget(drafter=c.file("d.json", json.dumps(drafter_raw_config(num_attention_heads=0)))),
        1,
        r"num_attention_heads is 0",
    ),
    R(
        "budget-zero-kv-heads",
        "budget",
        lambda c: c.budget(drafter=c.file("d.json", json.dumps(drafter_raw_config(num_key_value_heads=0)))),
        1,
        r"num_key_value_heads is 0",
    ),
    R(
        "budget-block-size-0",
        "budget",
        lambda c: c.budget(drafter=c.file("d.json", json.dumps(drafter_raw_config(block_size=0)))),
        1,
        r"block_size is 0; it must be >= 2",
    ),
    R("budget-group-size-0", "budget", lambda c: c.budget("--group-size", "0"), 2, r"--group-size 0 is invalid"),
    R("budget-negative-context", "budget", lambda c: c.budget("--context", "-1"), 2, r"--context must not be negative"),
    R("budget-unknown-gpu", "budget", lambda c: c.budget("--gpu", "rtx9999"), 2, r"unknown GPU 'rtx9999'"),
    R(
        "budget-zero-utilization",
        "budget",
        lambda c: c.budget("--gpu-memory-utilization", "0"),
        2,
        r"--gpu-memory-utilization must be in \(0, 1\]",
    ),
    R(
        "budget-negative-utilization",
        "budget",
        lambda c: c.budget("--gpu-memory-utilization", "-0.5"),
        2,
        r"--gpu-memory-utilization must be in \(0, 1\]",
    ),
    R(
        "budget-zero-concurrency",
        "budget",
        lambda c: c.budget("--concurrency", "0"),
        2,
        r"--concurrency must be at least 1",
    ),
    R(
        "budget-negative-spec-tokens",
        "budget",
        lambda c: c.budget("--spec-tokens", "-1"),
        2,
        r"--spec-tokens must not be negative",
    ),
    R("budget-unknown-engine", "budget", lambda c: c.budget("--engine", "trt"), 2, r"unknown --engine 'trt'"),
    R("budget-kv-dtype", "budget", lambda c: c.budget("--kv-dtype", "int3"), 2, r"unknown --kv-dtype 'int3'"),
    R(
        "budget-target-list",
        "budget",
        lambda c: c.budget(target=c.file("t.json", "[]")),
        1,
        r"t\.json is not a JSON object",
    ),
    R(
        "budget-target-zero-heads",
        "budget",
        lambda c: c.budget(target=c.target(num_attention_heads=0)),
        1,
        r"num_attention_heads is 0",
    ),
    R(
        "budget-target-billion-layers",
        "budget",
        lambda c: c.budget(target=c.file("t.json", json.dumps({**_qwen3_8b(), "num_hidden_layers": 10**9}))),
        1,
        r"num_hidden_layers 1,000,000,000 is implausible",
    ),
    R(
        "budget-drafter-header-terabytes",
        "budget",
        lambda c: c.budget(drafter=c.drafter(weights=header_claiming(c, 2**42))),
        1,
        r"truncated or corrupt",
    ),
    R(
        "budget-drafter-billion-layers",
        "budget",
        lambda c: c.budget(drafter=c.drafter(num_hidden_layers=10**9)),
        1,
        r"implausible|weights hold 2 layers",
    ),
    R(
        "budget-unknown-target",
        "budget",
        lambda c: c.budget(target="qwen9-1t"),
        1,
        r"'qwen9-1t' is not a preset, a directory or a config\.json",
    ),
    R(
        "budget-drafter-as-target",
        "budget",
        lambda c: c.budget(target=c.d),
        2,
        r"is a DFlash drafter config; pass the target",
    ),
    # --- --device-map / --max-memory / --hessian-device (issue #14): refused before any weight loads ---------
    R(
        "devmap-unknown-module",
        "arguments",
        lambda c: c.gptq("--device-map", '{"model.layers.9": "cpu", "": "cpu"}'),
        2,
        r"names \['model\.layers\.9'\] which .* does not have; its top-level modules are",
    ),
    R(
        "devmap-missing-gpu",
        "arguments",
        lambda c: c.gptq("--device-map", '{"": 3}'),
        2,
        r"device 3 does not exist",
    ),
    R(
        "devmap-unplaced",
        "arguments",
        lambda c: c.verify("--device-map", '{"model.embed_tokens": "cpu", "lm_head": "cpu"}'),
        2,
        r"leaves \d+ tensors of .* unplaced \(e\.g\. model\.layers\.0\.",
    ),
    R(
        "devmap-strategy",
        "arguments",
        lambda c: c.gptq("--device-map", "fastest"),
        2,
        r"--device-map 'fastest' is neither auto, balanced",
    ),
    R(
        "devmap-json",
        "arguments",
        lambda c: c.verify("--device-map", '{"lm_head": '),
        2,
        r"--device-map is not valid JSON",
    ),
    R(
        "devmap-place",
        "arguments",
        lambda c: c.gptq("--device-map", '{"": "tpu"}'),
        2,
        r"unknown device 'tpu'",
    ),
    R(
        "max-memory-size",
        "arguments",
        lambda c: c.gptq("--device-map", "auto", "--max-memory", "cpu=lots"),
        2,
        r"--max-memory: size 'lots' is not a size",
    ),
    R(
        "max-memory-alone",
        "arguments",
        lambda c: ["imatrix", c.d, "--target", c.t, "-o", str(c.tmp / "x.gguf"), "--max-memory", "cpu=1GiB"],
        2,
        r"--max-memory needs --device-map",
    ),
    R(
        "max-memory-with-json-map",
        "arguments",
        lambda c: c.gptq("--device-map", '{"": "cpu"}', "--max-memory", "cpu=1GiB"),
        2,
        r"applies to a strategy",
    ),
    R(
        "hessian-device-missing",
        "arguments",
        lambda c: c.gptq("--hessian-device", "cuda:2"),
        2,
        r"--hessian-device: device 2 does not exist",
    ),
    R(
        "hessian-device-word",
        "arguments",
        lambda c: c.gptq("--hessian-device", "gpu"),
        2,
        r"--hessian-device 'gpu' is not a device",
    ),
    R(
        "gpu-memory-limit-on-cpu",
        "arguments",
        lambda c: c.gptq("--gpu-memory-limit", "20GiB", "--device", "cpu"),
        2,
        r"--gpu-memory-limit caps a GPU; use it with --device cuda\[:N\], not 'cpu'",
    ),
    R(
        "gpu-memory-limit-word",
        "arguments",
        lambda c: c.gptq("--gpu-memory-limit", "lots"),
        2,
        r"--gpu-memory-limit",
    ),
    R(
        "mix-two-goals",
        "arguments",
        lambda c: c.gptq("--max-tau-loss", "0.01", "--max-bytes", "1MB"),
        2,
        r"--max-tau-loss and --max-bytes are exclusive; pick one goal",
    ),
    R(
        "mix-tau-loss-range",
        "arguments",
        lambda c: c.gptq("--max-tau-loss", "1.5"),
        2,
        r"--max-tau-loss must be in \(0, 1\)",
    ),
    R("mix-bytes-word", "arguments", lambda c: c.gptq("--max-bytes", "lots"), 2, r"cannot read --max-bytes 'lots'"),
    R("mix-fit-no-context", "arguments", lambda c: c.gptq("--fit", "rtx4090"), 2, r"--fit needs --context N"),
    R(
        "mix-context-without-fit",
        "arguments",
        lambda c: c.gptq("--context", "4096"),
        2,
        r"--context and --target-weights only apply with --fit GPU",
    ),
    R(
        "mix-fit-unknown-gpu",
        "arguments",
        lambda c: c.gptq("--fit", "gtx9999", "--context", "4096"),
        2,
        r"unknown GPU 'gtx9999'",
    ),
    R(
        "mix-with-rtn",
        "arguments",
        lambda c: c.gptq("--max-bytes", "1MB", "--method", "rtn"),
        2,
        r"mixed-precision search .* runs GPTQ .*; drop --method rtn",
    ),
    R(
        "mix-to-gguf",
        "arguments",
        lambda c: c.gptq("--max-bytes", "1MB", "--format", "gguf"),
        2,
        r"--format gguf holds one bit width for all Linears, not a per-Linear mix",
    ),
    R(
        "mix-bytes-too-small",
        "arguments",
        lambda c: c.gptq("--max-bytes", "1000"),
        2,
        r"--max-bytes 1000 leaves -?\d+ bytes for the quantized Linears .* the smallest mix takes \d+: raise the budget",
    ),
    R(
        "mix-fit-no-room",
        "arguments",
        lambda c: c.gptq("--fit", "64MiB", "--context", "16"),
        2,
        r"--fit 64MiB --context 16: no serving setting leaves room for the drafter \(the smallest mix needs .*\); "
        r"the most permissive \(kv_fp8; K=3, --kv-cache-dtype fp8\) leaves -.* lower --context, quantize the target",
    ),
    R(
        "mix-serving-knob-without-fit",
        "arguments",
        lambda c: c.gptq("--max-bytes", "1MB", "--spec-tokens", "4", "--no-prefix-caching"),
        2,
        r"--spec-tokens, --prefix-caching only apply with --fit GPU \(the serving settings of the budget\)",
    ),
    R(
        "mix-fit-bad-kv-dtype",
        "arguments",
        lambda c: c.gptq("--fit", "rtx4090", "--context", "4096", "--kv-dtype", "fp4"),
        2,
        r"unknown --kv-dtype 'fp4'; use one of bf16, fp16, fp32, fp8",
    ),
    R(
        "mix-fit-zero-spec-tokens",
        "arguments",
        lambda c: c.gptq("--fit", "rtx4090", "--context", "4096", "--spec-tokens", "0"),
        2,
        r"--spec-tokens must be at least 1 \(got 0\)",
    ),
    R(
        "mix-fit-utilization-range",
        "arguments",
        lambda c: c.gptq("--fit", "rtx4090", "--context", "4096", "--gpu-memory-utilization", "1.5"),
        2,
        r"--gpu-memory-utilization must be in \(0, 1\] \(got 1.5\)",
    ),
    R(
        "mix-fit-spec-tokens-above-block",
        "arguments",
        lambda c: c.gptq("--fit", "rtx4090", "--context", "4096", "--spec-tokens", "9"),
        2,
        r"--spec-tokens 9 is more than this drafter drafts per step \(block_size 4: at most 3\)",
    ),
    R(
        "mix-fit-cuda-graphs-word",
        "arguments",
        lambda c: c.gptq("--fit", "rtx4090", "--context", "4096", "--cuda-graphs", "some"),
        2,
        r"cannot read --cuda-graphs 'some'",
    ),
]


def _binary_config(c: Ctx) -> str:
    path = Path(c.drafter())
    (path / "config.json").write_bytes(b"{\xff}")
    return str(path)


def _dflash2(c: Ctx, **over) -> str:
    from tiny import dflash2_raw_config

    path = save_dflash2_drafter(c.tmp / "d2")
    raw = dflash2_raw_config()
    raw["dflash_config"] = {**raw["dflash_config"], **over}
    (path / "config.json").write_text(json.dumps(raw))
    return str(path)


def _pickle_only(c: Ctx) -> str:
    path = c.tmp / "pickled"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(drafter_raw_config()))
    (path / "pytorch_model.bin").write_bytes(b"\x80\x04not really")
    return str(path)


def _tampered(c: Ctx) -> str:
    art = c.artifact()
    data = bytearray((art / "model.safetensors").read_bytes())
    data[-100] ^= 1
    (art / "model.safetensors").write_bytes(bytes(data))
    return str(art)


def _edit_config(path: Path, **over) -> None:
    raw = json.loads((path / "config.json").read_text())
    raw.update(over)
    (path / "config.json").write_text(json.dumps({k: v for k, v in raw.items() if v is not None}))


def _ct_weights(path: Path, **over) -> None:
    raw = json.loads((path / "config.json").read_text())
    raw["quantization_config"]["config_groups"]["group_0"]["weights"].update(over)
    (path / "config.json").write_text(json.dumps(raw))


def _truncate_gguf(path: Path) -> None:
    f = next(path.glob("*.gguf"))
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


def _qwen3_8b() -> dict:
    from dflash_quant.memory.presets import load_preset

    return {k: v for k, v in load_preset("qwen3-8b").items() if not k.startswith("_")}


# --------------------------------------------------------------------------------------------- the runner


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    root = tmp_path_factory.mktemp("bad_inputs")
    models = root / "models"
    save_drafter(models / "drafter", std=0.2)
    save_target(models / "target")
    (models / "prompts.txt").write_text(LINE + "\n" + LINE.replace("w1", "w9") + "\n")
    (models / "calib.txt").write_text("\n".join(f"w{i} w{i + 1} w{i + 2} w{i + 3}" for i in range(3, 11)))
    (models / "eval.txt").write_text("w40 w41 w42 w43\n")
    art = make_artifact(root / "art", big_bytes=0)
    return models, art


@pytest.fixture(scope="module")
def exports(tmp_path_factory) -> dict[str, Path]:
    """`export` of an RTN GPTQ g32 artifact of the reference pair to every format (seconds: no calibration)."""
    from dflash_quant.cli.export_cmd import export_artifact
    from dflash_quant.pipeline.job import GptqJob
    from dflash_quant.pipeline.run import run_gptq
    from dflash_quant.quantize.settings import QuantSettings

    root = tmp_path_factory.mktemp("bad_inputs_exports")
    src = root / "gptq"
    run_gptq(GptqJob(output=src, quant=QuantSettings(method="rtn", group_size=32), verify=False, write_card=False))
    out = {}
    for fmt in ("gguf", "mlx", "compressed-tensors"):
        out[fmt] = root / fmt
        export_artifact(src, fmt, out[fmt], card=False)
    return out


def tree(root: Path) -> dict[str, str]:
    """Every entry under root (hidden ones too) with the sha256 of its bytes, '<dir>' or '<link>'."""
    out = {}
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root).as_posix()
        out[rel] = "<link>" if p.is_symlink() else "<dir>" if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def one_line_error(code: int, stderr: str, expected_code: int, pattern: str) -> None:
    assert code == expected_code, stderr
    assert "Traceback" not in stderr, stderr
    errors = [line for line in stderr.splitlines() if line.lower().startswith("error:")]
    assert len(errors) == 1, stderr
    assert re.search(pattern, errors[0]), errors[0]


def test_table_is_big_and_covers_every_group():
    assert len(ROWS) >= 60 and len({r.id for r in ROWS}) == len(ROWS)
    assert {r.group for r in ROWS} >= {
        "models",
        "arguments",
        "prompts",
        "artifacts",
        "push",
        "output",
        "signals",
        "concurrency",
        "budget",
        "exports",
    }


@pytest.mark.parametrize("row", ROWS, ids=[r.id for r in ROWS])
def test_bad_input(row: Row, shared, tmp_path, monkeypatch, request):
    models, art = shared
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    ctx = Ctx(models, art, scratch, request.getfixturevalue("exports") if row.group == "exports" else None)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    models_before = tree(models)
    built = row.build(ctx)
    before = tree(scratch)
    if isinstance(built, subprocess.CompletedProcess):
        one_line_error(built.returncode, built.stderr, row.code, row.pattern)
    else:
        res = CliRunner().invoke(app, built)
        assert res.exception is None or isinstance(res.exception, SystemExit), repr(res.exception)
        one_line_error(res.exit_code, res.stderr, row.code, row.pattern)
    after = tree(scratch)
    if not isinstance(built, subprocess.CompletedProcess):
        assert after == before, sorted(set(after.items()) ^ set(before.items()))
    else:  # the subprocess rows create nothing themselves: the scratch folder must be as empty as it started
        assert not [n for n in after if n == "out" or n.startswith(".out.")], after
    assert tree(models) == models_before


def test_cli_starts_without_torch():
    """Refusals are instant because the CLI imports torch only once work starts; a top-level import in any
    command module (one crept in with the quantized-target labels) would cost every refusal ~1.6 s."""
    code = "import sys, dflash_quant.cli.app; print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "[]", f"imported at CLI start-up: {res.stdout.strip()}"
