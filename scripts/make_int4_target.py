"""Write a compressed-tensors W4A16 (RTN) form of a dense target, e.g. the shipped reference target:

python scripts/make_int4_target.py reference:target /tmp/reference-target-w4g32 --group-size 32
"""

from __future__ import annotations

import argparse
from pathlib import Path

from dflash_quant.export.int4_target import write_int4_target
from dflash_quant.io.source import resolve
from dflash_quant.quantize.spec import QuantSpec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("target", help="dense target: directory, Hub id or reference:target")
    ap.add_argument("output", type=Path)
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=32)
    ap.add_argument("--asym", action="store_true", help="asymmetric grid (zero points)")
    ap.add_argument("--overwrite", action="store_true")
    args = ap.parse_args()
    spec = QuantSpec(bits=args.bits, group_size=args.group_size, sym=not args.asym)
    counts = write_int4_target(resolve(args.target).path, args.output, spec, overwrite=args.overwrite)
    print(f"wrote {args.output}: {counts['quantized']} packed Linears, {counts['dense']} dense tensors")


if __name__ == "__main__":
    main()
