"""Our CUDA int4 kernel (dflash_quant/kernels/int4_cuda.cu, int4_cuda.py).

CPU: the packed layout against the MMA operand layout of PTX's m16n8k16 (B fragment: lane l holds rows
2(l%4)+{0,1} and 2(l%4)+8+{0,1} of column l/4, lower k in the lower half), decoded with the kernel's own bit
operations (the bf16 128 + q trick), so a packing that feeds the wrong code to a lane fails here.
gpu: every split-K path against the fp32 dequantized matmul, odd shapes and rows, determinism, the
dequantizing path for many rows, a CUDA graph replay, the development variants. Where nvcc is installed (no GPU
needed): the source compiles for sm_80 and sm_90 with torch's builder flags (slow).
"""

from __future__ import annotations

import pytest
import torch

from dflash_quant.kernels.int4_cuda import CHUNK, lane_words, pack, unpack


def _bf16_bits(bits: torch.Tensor) -> torch.Tensor:
    """The value of 16-bit patterns (int64 holding 0..65535) read as bf16, in fp32."""
    return bits.to(torch.int32).to(torch.int16).view(torch.bfloat16).float()


@pytest.mark.parametrize("n,k", [(16, 128), (48, 384), (64, 256)])
def test_pack_round_trips(n, k):
    codes = torch.randint(0, 16, (n, k), generator=torch.Generator().manual_seed(n + k), dtype=torch.uint8)
    packed = pack(codes)
    assert packed.dtype == torch.int32 and packed.numel() == n * k // 8
    assert torch.equal(unpack(packed, n, k), codes)


def test_a_warps_pair_of_tiles_streams_in_kernel_order():
    """The kernel reads tile t of pair p, chunk kt, lane l at 16-byte word ((p * KT + kt) * 2 + t) * 32 + l."""
    n, k = 32, 384  # 2 pairs, 3 chunks
    codes = torch.zeros(n, k, dtype=torch.uint8)
    codes[24:32, 128:256] = 5  # pair 1, tile 1, chunk 1 only
    words = pack(codes).view(-1, 4)  # one row per 16-byte word
    nonzero = sorted({int(i) for i in torch.nonzero(words.any(dim=1)).flatten()})
    assert nonzero == [((1 * 3 + 1) * 2 + 1) * 32 + lane for lane in range(32)]


def test_each_lane_gets_its_mma_b_fragment():
    """Decode every lane's words as the kernel does and place them where m16n8k16 puts B's elements: the
    result must be W^T - z of each 8 x 128 tile, k16 step by step."""
    n, k = 16, 256
    gen = torch.Generator().manual_seed(3)
    codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    zeros = torch.randint(1, 17, (n,), generator=gen)  # GPTQ v1 zeros are 1..16
    words = lane_words(pack(codes), n, k)
    lane = torch.arange(32)
    gid, tig = lane // 4, lane % 4
    for nt in range(n // 8):
        for kt in range(k // CHUNK):
            z = zeros[nt * 8 + gid]  # each lane's output column
            neg_zero = _bf16_bits((0xC300 | z) & 0xFFFF)
            assert torch.equal(neg_zero, -(128.0 + z.float()))
            for j in range(8):
                bits = words[nt, kt, :, j >> 1] >> (8 * (j & 1))
                b = torch.zeros(16, 8)  # B[k][n] of this k16 step, as the lanes hold it
                for shift, row0 in ((0, 0), (4, 8)):  # b0: rows 2(l%4)+{0,1}; b1: the same + 8
                    pair = ((bits >> shift) & 0x000F000F) | 0x43004300  # code_pair
                    for half in (0, 1):
                        value = _bf16_bits((pair >> (16 * half)) & 0xFFFF) + neg_zero  # minus_zero
                        b[2 * tig + row0 + half, gid] = value
                want = codes[nt * 8 : nt * 8 + 8, kt * CHUNK + 16 * j : kt * CHUNK + 16 * j + 16].float()
                assert torch.equal(b.T, want - zeros[nt * 8 : nt * 8 + 8, None].float()), (nt, kt, j)


def test_the_code_trick_is_exact_for_every_code_and_zero():
    q = torch.arange(16).repeat_interleave(16)
    z = torch.arange(1, 17).repeat(16)
    assert torch.equal(_bf16_bits(0x4300 | q) - (128.0 + z), (q - z).float())
    assert torch.equal(_bf16_bits(0x4300 | q) + _bf16_bits(0xC300 | z), (q - z).float())


def test_a_missing_toolchain_is_named(monkeypatch, tmp_path):
    """Where torch's extension builder has no nvcc or no ninja, the reason says which and how to fix it (`auto`
    records it and moves on to the next kernel)."""
    from torch.utils import cpp_extension

    from dflash_quant.kernels.int4_cuda import toolchain_problem

    monkeypatch.delenv("PYTORCH_NVCC", raising=False)
    monkeypatch.setattr(cpp_extension, "CUDA_HOME", None)
    assert toolchain_problem() == "nvcc (the CUDA toolkit) was not found; set CUDA_HOME to build the CUDA kernel"
    monkeypatch.setattr(cpp_extension, "CUDA_HOME", str(tmp_path))  # a CUDA_HOME without bin/nvcc
    assert "nvcc" in (toolchain_problem() or "")
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "nvcc").write_text("#!/bin/sh\n")
    monkeypatch.setattr(cpp_extension, "is_ninja_available", lambda: False)
    assert toolchain_problem() == "ninja was not found (pip install ninja) to build the CUDA kernel"
    monkeypatch.setattr(cpp_extension, "is_ninja_available", lambda: True)
    assert toolchain_problem() is None


@pytest.mark.parametrize(
    "n,k,split",
    [
        (4096, 20480, 8),  # fc: 4 blocks/SM would allow 16 splits; at most 8
        (4096, 12288, 8),  # down
        (24576, 4096, 2),  # gate+up: 192 columns, one wave at 2
        (4096, 4096, 8),  # q, o: 32 chunks, at least 4 a block
        (2048, 4096, 8),  # k+v
        (4096, 1024, 2),  # 8 chunks: at least 4 a block
        (65536, 4096, 1),  # 512 columns fill the GPU alone
    ],
)
def test_the_split_fills_one_wave_with_at_least_4_chunks_and_at_most_8_splits(monkeypatch, n, k, split):
    """The H200's shape (132 SMs, 4 blocks of 128 outputs per SM): the split the drafter's GEMMs get."""
    import dflash_quant.kernels.int4_cuda as int4_cuda

    monkeypatch.setattr(int4_cuda, "_kernel_shape", lambda group, device, variant: (128, 4))
    monkeypatch.setattr(int4_cuda, "_sm_count", lambda device: 132)
    assert int4_cuda.config(n, k, 128, torch.device("cuda")) == split


def test_each_kernel_source_is_built_under_a_name_of_its_content(monkeypatch, tmp_path):
    """int4_cuda.build: the shipped kernel and the benchmarks' other versions of it are cached by torch under a name
    that carries their content, so an edited source is never served from an older build."""
    from torch.utils import cpp_extension

    from dflash_quant.kernels import int4_cuda

    seen: list[dict] = []
    monkeypatch.setattr(cpp_extension, "load", lambda **kw: seen.append(kw) or kw["name"])
    a, b = tmp_path / "a.cu", tmp_path / "b.cu"
    a.write_text("// one version\n")
    b.write_text("// another version\n")
    names = [int4_cuda.build(a, "x"), int4_cuda.build(b, "x"), int4_cuda.build(a, "x")]
    assert names[0] == names[2] != names[1] and all(n.startswith("x_") for n in names)
    assert seen[0]["sources"] == [str(a)] and "-O3" in seen[0]["extra_cuda_cflags"]
    assert int4_cuda.build(int4_cuda.SOURCE).startswith("dflash_quant_int4_")  # the shipped module's name


def test_the_split_rule_takes_a_block_count_in_place_of_the_occupancy(monkeypatch):
    """benchmarks/gpu_int4.py's cuda:bN: a kernel variant that fits 5 blocks an SM measured at the split of 4."""
    import dflash_quant.kernels.int4_cuda as int4_cuda

    monkeypatch.setattr(int4_cuda, "_kernel_shape", lambda group, device, variant: (128, 5 if variant else 4))
    monkeypatch.setattr(int4_cuda, "_sm_count", lambda device: 132)
    cuda = torch.device("cuda")
    assert int4_cuda.config(24576, 4096, 128, cuda, variant=3) == 3  # 660 block slots over 192 columns
    assert int4_cuda.config(24576, 4096, 128, cuda, variant=3, per_sm=4) == 2  # 528
    assert int4_cuda.config(24576, 4096, 128, cuda, per_sm=8) == 5


def test_the_parts_benchmark_edits_the_kernel_source_it_times(tmp_path):
    """benchmarks/int4/int4_cuda_parts.py leaves one stage out of the kernel by replacing its text: every edit of a part
    must find its text exactly once in the shipped source (a kernel change that moves it fails here, not on the
    GPU), and must change the source."""
    import importlib.util
    import sys
    from pathlib import Path

    from dflash_quant.kernels.int4_cuda import SOURCE

    folder = Path(__file__).resolve().parents[1] / "benchmarks" / "int4"
    sys.path.insert(0, str(folder))
    try:
        spec = importlib.util.spec_from_file_location("int4_cuda_parts_bench", folder / "int4_cuda_parts.py")
        assert spec is not None and spec.loader is not None
        parts = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(parts)
    finally:
        sys.path.remove(str(folder))
    shipped = SOURCE.read_text()
    applied = parts.parts_for(shipped)
    assert {"no_loads", "no_sum", "no_multiply", "no_zero", "no_mma"} <= set(applied)
    assert "bulk_no_multiply" not in parts.parts_for(shipped.replace("w4a16_bulk_kernel", "w4a16_kernel"))
    assert {"sum_not_run", "sum_relaxed", "sum_stores_only", "sum_no_last"} <= set(parts.PROBES)
    for name, edits in (applied | parts.PROBES).items():
        edited = parts.variant_source(edits, tmp_path, name).read_text()
        assert edited != shipped
        for old, new in edits:
            assert old not in edited and new in edited
    with pytest.raises(SystemExit, match="occurs 0 times"):
        parts.variant_source([("no such line in the kernel", "")], tmp_path, "missing")


def test_the_benchmarks_kernel_options_set_the_variant_and_split(monkeypatch):
    """benchmarks/gpu_int4.py's cuda:OPT[:OPT]: vN the variant, bN the rule's blocks an SM, xF the split scaled;
    anything else is refused by name."""
    import importlib.util
    import types
    from pathlib import Path

    import dflash_quant.kernels.int4_cuda as int4_cuda

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_int4.py"
    spec = importlib.util.spec_from_file_location("gpu_int4_bench", path)
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    monkeypatch.setattr(int4_cuda, "_kernel_shape", lambda group, device, variant: (128, 5 if variant else 4))
    monkeypatch.setattr(int4_cuda, "_sm_count", lambda device: 132)

    def gate_up(options: list[str]) -> tuple[int, int]:
        mod = types.SimpleNamespace(out_features=24576, in_features=4096, group_size=128, qweight=torch.empty(0))
        mod._cuda_variant, mod._cuda_split = 0, 2
        bench.cuda_variant(mod, options)
        return mod._cuda_variant, mod._cuda_split

    assert gate_up(["x2"]) == (0, 4)
    assert gate_up(["v3"]) == (3, 3)  # 5 blocks an SM: 660 slots over 192 columns
    assert gate_up(["b4", "v3"]) == (3, 2)  # the order of the options does not matter
    assert gate_up(["v3", "x0.5"]) == (3, 2)  # round(1.5)
    for bad in (["q1"], ["v"], ["x"]):
        with pytest.raises(ValueError, match="cuda variant"):
            gate_up(bad)


gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _layer(out_f: int, in_f: int, group: int, seed: int):
    from dflash_quant.kernels.int4_cuda import CudaWeights
    from dflash_quant.kernels.int4_linear import Int4Codes

    gen = torch.Generator().manual_seed(seed)
    g = in_f // group
    codes = torch.randint(0, 16, (out_f, in_f), generator=gen, dtype=torch.uint8)
    zeros = torch.randint(1, 17, (g, out_f), generator=gen)
    scales = (torch.rand(g, out_f, generator=gen) * 0.02 + 1e-3).to(torch.float16)
    c = Int4Codes(codes, zeros, scales, torch.arange(in_f) // group, group).to(torch.device("cuda"))
    return c, CudaWeights(c.codes, c.zeros, c.scales, group)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("split", [1, 2, 3, 16, 64])
@pytest.mark.parametrize(
    "out_f,in_f,group", [(1008, 1024, 128), (256, 1152, 32), (144, 640, 64), (512, 768, 768), (272, 1536, 256)]
)
@pytest.mark.parametrize("rows", [1, 7, 16, 17, 32])
def test_every_path_against_the_fp32_dequantized_matmul(split, out_f, in_f, group, rows):
    from dflash_quant.kernels.int4_cuda import matmul

    c, w = _layer(out_f, in_f, group, seed=out_f + in_f + rows)
    x = torch.randn(rows, in_f, device="cuda").to(torch.bfloat16)
    args = (w.qweight, w.scales, w.zeros, w.counters, group, split)
    poison = torch.full((rows, out_f), float("nan"), device="cuda", dtype=torch.bfloat16)
    del poison  # the allocator hands this block to the output next: an element never written stays NaN
    out = matmul(x, *args)
    ref = x.double() @ c.dequantize().double().T
    rel = float((out.double() - ref).abs().max() / ref.abs().max())
    assert rel < 4e-3, rel  # the bf16 output's rounding: no weight is rounded
    assert torch.isfinite(out).all()
    assert torch.equal(matmul(x, *args), out)  # fixed summation order
    assert int(w.counters.abs().sum()) == 0  # every counter left at zero for the next launch


@pytest.mark.gpu
@gpu
def test_many_rows_use_the_dequantized_bf16_weight():
    from dflash_quant.kernels.int4_cuda import matmul, module

    c, w = _layer(256, 512, 64, seed=1)
    bf16 = module().w4_dequant(w.qweight, w.scales, w.zeros, 64)
    assert torch.equal(bf16, c.dequantize().to(torch.bfloat16))  # the dequantized path's weight, bit for bit
    x = torch.randn(100, 512, device="cuda").to(torch.bfloat16)
    assert torch.equal(matmul(x, w.qweight, w.scales, w.zeros, w.counters, 64, 2), x @ bf16.T)


@pytest.mark.gpu
@gpu
def test_a_cuda_graph_replays_the_split_k_kernel():
    from dflash_quant.kernels.int4_cuda import matmul

    c, w = _layer(512, 2048, 128, seed=2)
    x = torch.randn(16, 2048, device="cuda").to(torch.bfloat16)
    args = (w.qweight, w.scales, w.zeros, w.counters, 128, 8)
    eager = matmul(x, *args)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        matmul(x, *args)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = matmul(x, *args)
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, matmul(x, *args))
    assert not torch.equal(out, eager)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("variant", [1, 2, 3, 4, 5, 6])
@pytest.mark.parametrize("split", [1, 3, 16])
@pytest.mark.parametrize("out_f,in_f", [(1008, 1024), (272, 2304), (1024, 1536)])  # the last: whole 128-wide columns
def test_development_variants_against_the_fp32_dequantized_matmul(variant, split, out_f, in_f):
    from dflash_quant.kernels.int4_cuda import matmul

    c, w = _layer(out_f, in_f, 128, seed=variant + split)
    ref_w = c.dequantize().double()
    for rows in (1, 16):
        x = torch.randn(rows, in_f, device="cuda").to(torch.bfloat16)
        out = matmul(x, w.qweight, w.scales, w.zeros, w.counters, 128, split, variant)
        ref = x.double() @ ref_w.T
        assert float((out.double() - ref).abs().max() / ref.abs().max()) < 4e-3
        assert int(w.counters.abs().sum()) == 0
        shipped = matmul(x, w.qweight, w.scales, w.zeros, w.counters, 128, split, 0)
        if variant not in (4, 5):  # the same sums in the same order as the shipped kernel: the same bits
            assert torch.equal(out, shipped)
        else:  # the zero through the rows' sums: another fp32 path, within the bf16 output's rounding of it
            assert float((out.double() - shipped.double()).abs().max() / ref.abs().max()) < 4e-3
            assert not torch.equal(out, shipped) or rows == 1


def _sass_tool():
    """benchmarks/int4/int4_sass.py, which holds the nvcc command (torch's builder flags) and the SASS reading."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        "int4_sass", Path(__file__).resolve().parents[1] / "benchmarks" / "int4" / "int4_sass.py"
    )
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


int4_sass = _sass_tool()


@pytest.mark.slow
@pytest.mark.skipif(int4_sass.cuda_tool("nvcc") is None, reason="nvcc not found (set CUDA_HOME)")
def test_the_kernel_compiles_without_a_gpu(tmp_path):
    """The CUDA source compiles for the oldest supported GPU (sm_80) and the H200's (sm_90) with the flags torch's
    extension builder passes, so a change that breaks the build fails here, not on the first GPU run (one nvcc
    call for both: the host side, most of the time, compiles once). A CPU build of torch ships no
    c10/cuda/impl/cuda_cmake_macros.h: a one-line stand-in takes its place."""
    import subprocess

    from dflash_quant.kernels.int4_cuda import SOURCE

    cmd = int4_sass.nvcc_command(SOURCE, tmp_path / "int4_cuda.o", ["80", "90"], tmp_path / "inc")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "int4_cuda.o").stat().st_size > 0
    # every instance the dispatch can launch was compiled for each architecture (ptxas names each kernel)
    for arch in ("sm_80", "sm_90"):
        entries = [
            line
            for line in proc.stderr.splitlines()
            if "Compiling entry" in line and "w4a16_kernel" in line and line.endswith(f"for '{arch}'")
        ]
        kernels = {line.split("w4a16_kernel")[1].split("v")[0] for line in entries}  # the template arguments
        assert len(kernels) == 14, (arch, kernels)  # 4 groups x 2 row tiles + 6 development variants


def test_the_sass_reader_finds_the_loop_with_the_mmas_and_the_registers():
    """benchmarks/int4/int4_sass.py's reading of cuobjdump and ptxas output, on a hand-written listing: the innermost
    backward-branch loop holding HMMAs, not the longer loop around it nor the MMA-free tail loop."""
    sass = "\n".join(
        f"        /*{addr:04x}*/                   {text} ;"
        for addr, text in [
            (0x0000, "S2R R0, SR_TID.X"),
            (0x0010, "LDS R4, [R0]"),  # outer loop starts here
            (0x0020, "LOP3.LUT R5, R4, 0xf000f, RZ, 0xc0, !PT"),  # main loop starts here
            (0x0030, "HMMA.16816.F32.BF16 R8, R12, R5, R8"),
            (0x0040, "@P0 BRA 0x20"),
            (0x0050, "@P1 BRA 0x10"),
            (0x0060, "LDG.E.128 R4, [R2.64]"),  # tail loop without MMAs
            (0x0070, "FADD R8, R8, R4"),
            (0x0080, "@P2 BRA 0x60"),
            (0x0090, "EXIT"),
        ]
    )
    loop = int4_sass.main_loop(sass)
    assert loop == [
        "LOP3.LUT R5, R4, 0xf000f, RZ, 0xc0, !PT",
        "HMMA.16816.F32.BF16 R8, R12, R5, R8",
        "@P0 BRA 0x20",
    ]
    log = (
        "ptxas info    : Compiling entry function '_ZN1aw4a16_kernelILi2ELi1ELi3ELb0ELb0EEEv' for 'sm_90'\n"
        "ptxas info    : Used 40 registers, used 1 barriers\n"
        "ptxas info    : Compiling entry function '_ZN1aw4a16_kernelILi8ELi1ELi3ELb0ELb1EEEv' for 'sm_90'\n"
        "ptxas info    : Used 64 registers, used 1 barriers\n"
        "ptxas info    : Compiling entry function '_ZN1aw4a16_kernelILi8ELi1ELi3ELb0ELb0EEEv' for 'sm_90'\n"
        "ptxas info    : Used 62 registers, used 1 barriers\n"
    )  # the shipped instance, not variant 6 (DISCARD) whose name it prefixes up to the last flag
    assert int4_sass.registers(log) == ("_ZN1aw4a16_kernelILi8ELi1ELi3ELb0ELb0EEEv", 62)
