"""A mirror of next/v25_bulk_copies.patch's copy plan, run without a GPU: which global byte each shared-memory byte
of a stage holds after the producer warp's bulk copies, and whether every consumer read (codes, zeros, scales,
x through ldmatrix) finds the byte that the cp.async kernel reads for the same warp and chunk. Six shapes: groups
32 to 768, 1 to 32 rows, a last block column of fewer than 8 pairs, a tail stage of fewer chunks.

python3 benchmarks/results/int4_cuda_dev/next/plan_check.py
"""

WARPS = 8


def stage_bytes(bx, k, n, n_rows, shape):
    """{shared byte: global byte} after one stage's copies (the producer's loop, written out)."""
    big_n, kt, np_, ng, gk, gc, cpb = shape
    codes, zs, xrow = WARPS * cpb * 1024, cpb * ng * 384, cpb * 256 + 16
    n0 = bx * WARPS * 16
    outs = min(WARPS * 16, big_n - n0)
    zs_copies = n * ng
    smem = {}
    for c in range(WARPS + n_rows + 2 * zs_copies):
        if c < WARPS:
            p = min(bx * WARPS + c, np_ - 1)
            smem.update({c * cpb * 1024 + b: ("qw", (p * kt + k) * 1024 + b) for b in range(n * 1024)})
        elif c < WARPS + n_rows:
            r = c - WARPS
            smem.update({codes + zs + r * xrow + b: ("x", r, k * 256 + b) for b in range(n * 256)})
        else:
            zc = c - WARPS - n_rows
            z = zc if zc < zs_copies else zc - zs_copies
            g = (k + z // ng) // gc if gk == 16 else (k + z // ng) * ng + z % ng
            if zc < zs_copies:
                smem.update({codes + z * 384 + b: ("z", g * big_n + n0 + b) for b in range(outs)})
            else:
                smem.update({codes + z * 384 + 128 + b: ("s", 2 * (g * big_n + n0) + b) for b in range(2 * outs)})
    return smem


def check(big_n, k_in, group, m, mt, cpb, chunks):
    ng = 8 // (group // 16) if group < 128 else 1
    gk = {32: 2, 64: 4, 128: 8}.get(group, 16)
    kt, np_, gc = k_in // 128, big_n // 16, max(1, group // 128)
    codes, zs, xrow = WARPS * cpb * 1024, cpb * ng * 384, cpb * 256 + 16
    shape = (big_n, kt, np_, ng, gk, gc, cpb)
    for bx in range(-(-np_ // WARPS)):
        for by in range(-(-kt // chunks)):
            kt0 = by * chunks
            kt1 = min(kt0 + chunks, kt)
            for t in range(-(-(kt1 - kt0) // cpb)):
                k = kt0 + t * cpb
                n = min(cpb, kt1 - k)
                smem = stage_bytes(bx, k, n, min(m, 16 * mt), shape)
                for warp in range(WARPS):
                    pair = bx * WARPS + warp
                    if pair >= np_:
                        continue
                    for ci in range(n):
                        kk = k + ci
                        g0 = kk // gc if gk == 16 else kk * ng
                        for lane in range(32):
                            gid, tig = lane >> 2, lane & 3
                            for i in range(2):
                                for b in range(16):  # the cp.async kernel: (p * KT * 64 + lane) * 16 + k * 1024 + 512 i
                                    want = ("qw", (pair * kt * 64 + lane) * 16 + kk * 1024 + 512 * i + b)
                                    assert smem[(warp * cpb + ci) * 1024 + 512 * i + 16 * lane + b] == want
                                for g in range(ng):
                                    gg = g0 + (0 if gk == 16 else g)
                                    at = codes + ci * ng * 384 + 384 * g
                                    assert smem[at + 16 * warp + 8 * i + gid] == (
                                        "z",
                                        gg * big_n + 16 * pair + 8 * i + gid,
                                    )
                                    for b in range(4):
                                        want = ("s", 2 * (gg * big_n + 16 * pair + 8 * i + 2 * tig) + b)
                                        assert smem[at + 128 + 2 * (16 * warp + 8 * i + 2 * tig) + b] == want
                            for tile in range(mt):  # ldmatrix: row lane % 16, column 16 j + 8 (lane / 16), 16 bytes
                                r = 16 * tile + (lane & 15)
                                if r >= m:
                                    continue
                                for j in range(8):
                                    col = (16 * j + 8 * (lane >> 4)) * 2
                                    for b in range(16):
                                        want = ("x", r, kk * 256 + col + b)
                                        assert smem[codes + zs + r * xrow + ci * 256 + col + b] == want


if __name__ == "__main__":
    for case in [
        (1008, 1024, 128, 16, 1, 1, 3),
        (272, 2304, 128, 1, 1, 2, 2),
        (256, 1152, 32, 7, 1, 1, 2),
        (144, 640, 64, 17, 2, 1, 1),
        (512, 768, 768, 32, 2, 1, 2),
        (272, 1536, 256, 16, 1, 2, 3),
    ]:
        check(*case)
        print("out, in, group, rows, row tiles, chunks a stage, chunks a block:", case, "ok")
