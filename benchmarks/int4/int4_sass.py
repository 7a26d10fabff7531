"""The int4 kernel's registers and main loop as ptxas and cuobjdump see them, compiled without a GPU (issue #16).

Compiles `dflash_quant/kernels/int4_cuda.cu` for sm_90 with torch's builder flags, and with `--part NAME` also the build
with that part left out (`int4_cuda_parts.py`'s edits), then prints for the group-128, 16-row instance (the
drafter's) the registers ptxas gave it and the length of its main loop: the loop with the MMAs, from its label to
its backward branch. cuobjdump comes from the CUDA toolkit or, where the toolkit has none, from triton's wheel
(`pip download --no-deps triton`, unzipped; pass --cuobjdump).

python benchmarks/int4/int4_sass.py --part no_sum
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from collections.abc import Sequence
from pathlib import Path

# group 128 (8 chunks a group step), one row tile, 3 slots, no ZR, no DISCARD (variant 6's name differs only there)
INSTANCE = "w4a16_kernelILi8ELi1ELi3ELb0ELb0E"


def cuda_tool(name: str) -> str | None:
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    return shutil.which(name) or (home and shutil.which(name, path=os.path.join(home, "bin"))) or None


def nvcc_command(source: Path, obj: Path, arch: str | Sequence[str], include: Path) -> list[str]:
    """nvcc with the flags torch's extension builder passes, for one GPU architecture or several (one host
    compilation serves them all). A CPU build of torch ships no c10/cuda/impl/cuda_cmake_macros.h: a one-line
    stand-in is written under `include`."""
    from torch.utils import cpp_extension

    stub = include / "c10" / "cuda" / "impl"
    stub.mkdir(parents=True, exist_ok=True)
    (stub / "cuda_cmake_macros.h").write_text("#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n")
    return [
        str(cuda_tool("nvcc")),
        "-std=c++17",
        "-O3",
        *[f"-gencode=arch=compute_{a},code=sm_{a}" for a in ([arch] if isinstance(arch, str) else arch)],
        "-Xptxas",
        "-v",
        *cpp_extension.COMMON_NVCC_FLAGS,
        f"-I{include}",
        *[f"-I{p}" for p in cpp_extension.include_paths()],
        f"-I{sysconfig.get_paths()['include']}",
        "-DTORCH_EXTENSION_NAME=int4_cuda_check",
        "-D_GLIBCXX_USE_CXX11_ABI=1",
        "-c",
        str(source),
        "-o",
        str(obj),
    ]


def registers(ptxas_log: str, instance: str = INSTANCE) -> tuple[str, int]:
    """(mangled name, registers) of the instance from ptxas -v's log."""
    name = re.search(rf"Compiling entry function '(\w*{instance}\w*)'", ptxas_log)
    if not name:
        raise SystemExit(f"ptxas compiled no {instance}")
    after = ptxas_log[name.end() :]
    return name.group(1), int(re.search(r"Used (\d+) registers", after).group(1))  # type: ignore[union-attr]


def main_loop(sass: str) -> list[str]:
    """The instructions of the innermost backward-branch loop that holds MMAs (HMMA), from cuobjdump's SASS."""
    ins = [(int(a, 16), t.strip()) for a, t in re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    index = {a: i for i, (a, _) in enumerate(ins)}
    best: list[str] = []
    for i, (addr, text) in enumerate(ins):
        target = re.search(r"\bBRA\b.*?0x([0-9a-f]+)", text)
        if not target or int(target.group(1), 16) >= addr or int(target.group(1), 16) not in index:
            continue
        body = [t for _, t in ins[index[int(target.group(1), 16)] : i + 1]]
        if any("HMMA" in t for t in body) and (not best or len(body) < len(best)):
            best = body
    return best


def inspect(source: Path, work: Path, cuobjdump: str) -> dict:
    obj = work / (source.stem + ".o")
    proc = subprocess.run(nvcc_command(source, obj, "90", work / "inc"), capture_output=True, text=True, timeout=900)
    if proc.returncode:
        raise SystemExit(proc.stderr[-2000:])
    name, regs = registers(proc.stderr)
    sass = subprocess.run([cuobjdump, "--dump-sass", "--function", name, str(obj)], capture_output=True, text=True)
    loop = main_loop(sass.stdout)
    return {"registers": regs, "main_loop_instructions": len(loop), "hmma": sum("HMMA" in t for t in loop)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--part", action="append", default=[], help="also this build of int4_cuda_parts.py (a part or probe)"
    )
    ap.add_argument("--cuobjdump", default=cuda_tool("cuobjdump"), help="cuobjdump (default: the CUDA toolkit's)")
    args = ap.parse_args()
    if cuda_tool("nvcc") is None or not args.cuobjdump:
        raise SystemExit("nvcc and cuobjdump are needed: set CUDA_HOME, or pass --cuobjdump (triton's wheel has one)")
    sys.path[:0] = [str(Path(__file__).resolve().parents[2]), str(Path(__file__).resolve().parent)]
    from int4_cuda_parts import PARTS, PROBES, variant_source

    from dflash_quant.kernels.int4_cuda import SOURCE

    builds = PARTS | PROBES
    if unknown := [p for p in args.part if p not in builds]:
        raise SystemExit(f"unknown --part {', '.join(unknown)}: use one of {', '.join(builds)}")
    work = Path(tempfile.mkdtemp(prefix="int4_sass_"))
    sources = {"shipped": SOURCE} | {p: variant_source(builds[p], work, p) for p in args.part}
    for label, src in sources.items():
        print(label, inspect(src, work, args.cuobjdump), flush=True)


if __name__ == "__main__":
    main()
