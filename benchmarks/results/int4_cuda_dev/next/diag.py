"""Which kernel/launch segfaults: one subprocess per (source, variant), CUDA_LAUNCH_BLOCKING, faulthandler."""

import json
import os
import subprocess
import sys
from pathlib import Path

CHILD = r"""
import faulthandler, sys, torch
faulthandler.enable()
from pathlib import Path
sys.path.insert(0, ".")
from dflash_quant.kernels.int4_cuda import CudaWeights, build
ext = build(Path(sys.argv[1]), "diag")
variant = int(sys.argv[2])
g = torch.Generator().manual_seed(0)
out_f, in_f, group = 1008, 1024, 128
codes = torch.randint(0, 16, (out_f, in_f), generator=g, dtype=torch.uint8).cuda()
zeros = torch.randint(1, 17, (in_f // group, out_f), generator=g).cuda()
scales = (torch.rand(in_f // group, out_f, generator=g) * 0.02 + 1e-3).half().cuda()
w = CudaWeights(codes, zeros, scales, group)
x = torch.randn(16, in_f, device="cuda").bfloat16()
ref = x.double() @ ((codes.double() - zeros.double().repeat_interleave(group, 0).T) * scales.double().repeat_interleave(group, 0).T).T
for split in (1, 3):
    y = ext.w4a16_mm(x, w.qweight, w.scales, w.zeros, w.counters, group, split, variant)
    torch.cuda.synchronize()
    print("split", split, "rel", float((y.double() - ref).abs().max() / ref.abs().max()), flush=True)
"""
res = {}
for src, variants in ((sys.argv[1], [8, 0]), (sys.argv[2], [8, 0, 8 + 512, 8 + 256, 512, 256])):
    for v in variants:
        p = subprocess.run(
            [sys.executable, "-c", CHILD, src, str(v)],
            capture_output=True,
            text=True,
            timeout=400,
            env={**os.environ, "CUDA_LAUNCH_BLOCKING": "1"},
        )
        key = f"{Path(src).name}:v{v}"
        res[key] = {"rc": p.returncode, "out": p.stdout[-400:], "err": p.stderr[-1500:]}
        print(
            key,
            p.returncode,
            p.stdout.strip().replace("\n", " | "),
            p.stderr.strip().splitlines()[-3:] if p.returncode else "",
            flush=True,
        )
Path(sys.argv[3]).write_text(json.dumps(res, indent=1))
