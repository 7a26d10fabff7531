"""The mixed search's solvers (#12): clip search of each group's range, act-order with static groups, per-Linear
solvers in quantize_drafter, and the table holding them; all write plain GPTQ v1 tensors."""

import torch
from tiny import save_drafter

from dflash_quant.calibration.capture import CalibrationStats, input_group
from dflash_quant.calibration.hessian import HessianAccumulator
from dflash_quant.export.gptq_v1 import pack_gptq_v1
from dflash_quant.io.gptq_v1 import unpack_gptq_v1
from dflash_quant.loading.drafter import load_drafter
from dflash_quant.quantize.drafter import quantize_drafter
from dflash_quant.quantize.gptq import gptq_quantize
from dflash_quant.quantize.gptq_batched import gptq_quantize_many
from dflash_quant.quantize.grid import CLIP_SHRINKS, clip_params, find_params, group_params
from dflash_quant.quantize.mixed import Candidate, output_error
from dflash_quant.quantize.mixed_table import build_table, load_table, save_table
from dflash_quant.quantize.settings import QuantSettings
from dflash_quant.quantize.spec import QuantSpec


def _heavy(rows: int, cols: int, seed: int) -> torch.Tensor:
    """Weights with a few large entries per row, as trained Linears have: clipping them pays off at low bits."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g) * 0.02
    spikes = torch.rand(rows, cols, generator=g) < 0.01
    return torch.where(spikes, w * 12, w)


def _hessian(cols: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(4 * cols, cols, generator=g) * torch.linspace(0.2, 3.0, cols)  # uneven input scales
    acc = HessianAccumulator(cols)
    acc.add(x)
    return acc.hessian()


def _werr(w, s, z, maxq, cw):
    q = torch.clamp(torch.round(w / s[:, None]) + z[:, None], 0, maxq)
    return (cw * (w - s[:, None] * (q - z[:, None])) ** 2).sum(dim=1)


def test_clip_params_never_worse_and_shrinks_where_it_pays():
    w = _heavy(64, 32, 0)
    cw = torch.rand(32, generator=torch.Generator().manual_seed(1)) + 0.5
    for sym in (True, False):
        for bits in (2, 3, 4, 8):
            spec = QuantSpec(bits, 32, sym)
            s0, z0 = find_params(w, spec)
            s1, z1 = clip_params(w, spec, cw)
            e0, e1 = _werr(w, s0, z0, spec.maxq, cw), _werr(w, s1, z1, spec.maxq, cw)
            assert (e1 <= e0 + 1e-12).all()  # factor 1 is tried: never above find_params, row by row
            assert torch.equal(s1.half().float(), s1)  # still fp16 scales, as GPTQ v1 stores them
            if bits <= 3:  # with spikes, a coarse grid gains from clipping on most rows
                assert (e1 < e0).float().mean() > 0.5 and e1.sum() < e0.sum()
            # the chosen row parameters are one of the tried shrinks' own find_params
            tried = [find_params(w * f, spec) for f in CLIP_SHRINKS]
            for r in range(0, 64, 7):
                assert any(float(s[r]) == float(s1[r]) and float(z[r]) == float(z1[r]) for s, z in tried)


def test_gptq_clip_uses_static_searched_groups_and_matches_the_batched_solver():
    W, H = _heavy(64, 128, 2), _hessian(128, 3)
    spec = QuantSpec(3, 32, True)
    for act in (False, True):
        qw = gptq_quantize(W, H, spec, desc_act=act, clip=True)
        s, z = group_params(W, spec, col_weight=H.diagonal())
        assert torch.equal(qw.scales, s) and torch.equal(qw.zeros, z.to(torch.int32))  # fixed up front
        assert torch.equal(qw.g_idx, torch.arange(128, dtype=torch.int32) // 32)  # group-contiguous: plain v1
        assert qw.static_groups
        many = gptq_quantize_many([(W, H, "x")], spec, desc_act=act, clip=True, kernel="torch")[0]
        assert torch.equal(many.codes, qw.codes) and torch.equal(many.scales, qw.scales)
        # what a GPTQ v1 reader decodes (g_idx, scales, zeros as stored) is the weight we measured
        assert torch.equal(unpack_gptq_v1(pack_gptq_v1(qw), 3, 32).float(), qw.dequantize())
    # on spiky weights at 3 bits the searched solvers lower the GPTQ objective itself
    plain = output_error(W, gptq_quantize(W, H, spec).dequantize(), H)
    tuned = output_error(W, gptq_quantize(W, H, spec, desc_act=True, static_groups=True, clip=True).dequantize(), H)
    assert tuned < plain


def test_quantize_drafter_solves_each_linear_as_picked(tmp_path):
    drafter = load_drafter(save_drafter(tmp_path / "d", std=0.2), device="cpu", dtype=torch.float32)
    names = drafter.model.linear_names()
    kv = "block"
    hess = {}
    for i, grp in enumerate(sorted({input_group(n, kv) for n in names})):
        width = next(drafter.model.get_submodule(n).weight.shape[1] for n in names if input_group(n, kv) == grp)
        acc = HessianAccumulator(width, name=grp)
        acc.add(torch.randn(256, width, generator=torch.Generator().manual_seed(i)))
        hess[grp] = acc
    stats = CalibrationStats(hessians=hess, kv_hessian=kv)
    source = {n: drafter.model.get_submodule(n).weight.detach().clone() for n in names}
    solvers = [(False, False), (True, False), (False, True), (True, True)]
    picks = {n: (3, 32) for n in names}
    solve = {n: solvers[i % 4] for i, n in enumerate(names)}
    outcome = quantize_drafter(drafter.model, stats, QuantSettings(bits=4, group_size=32), picks=picks, solve=solve)
    assert sorted(e["name"] for e in outcome.layers) == sorted(names)
    for n in names:
        act, clip = solve[n]
        H = hess[input_group(n, kv)].hessian()
        want = gptq_quantize(source[n], H, QuantSpec(3, 32), desc_act=act, static_groups=act, clip=clip)
        got = outcome.weights[n]
        # alone vs stacked with its shared-input neighbours: GPTQ rows are independent, the codes agree
        assert torch.equal(got.codes, want.codes), n
        assert torch.equal(got.g_idx, torch.arange(got.g_idx.numel(), dtype=torch.int32) // 32)


def test_table_keeps_the_solvers_and_the_best_is_at_most_plain(tmp_path):
    W = {"layers.0.self_attn.o_proj": _heavy(64, 128, 4)}
    acc = HessianAccumulator(128, name="layers.0.self_attn.o_proj")
    acc.add(torch.randn(512, 128, generator=torch.Generator().manual_seed(5)) * torch.linspace(0.2, 3.0, 128))
    stats = CalibrationStats(hessians={"layers.0.self_attn.o_proj": acc}, kv_hessian="block")
    cands = [Candidate(b, 32, a, c) for b in (2, 3) for a in (False, True) for c in (False, True)]
    table = build_table(W, stats, cands)
    save_table(tmp_path, table, {"k": 1})
    assert load_table(tmp_path, {"k": 1}) == table  # act/clip survive the cache
    row = table["layers.0.self_attn.o_proj"]
    for b in (2, 3):
        sizes = {row[Candidate(b, 32, a, c)][0] for a in (False, True) for c in (False, True)}
        assert len(sizes) == 1  # a solver never changes the bytes
        assert (
            min(row[Candidate(b, 32, a, c)][1] for a in (False, True) for c in (False, True)) < row[Candidate(b, 32)][1]
        )


def test_uniform_clip_search_setting_is_the_clip_solver(tmp_path):
    """`gptq --clip-search` (QuantSettings.clip_search) on a whole drafter: every Linear solved with clip=True."""
    drafter = load_drafter(save_drafter(tmp_path / "d", std=0.2), device="cpu", dtype=torch.float32)
    names = drafter.model.linear_names()
    widths = {input_group(n, "block"): drafter.model.get_submodule(n).weight.shape[1] for n in names}
    hess = {}
    for i, (grp, width) in enumerate(sorted(widths.items())):
        hess[grp] = HessianAccumulator(width, name=grp)
        hess[grp].add(torch.randn(256, width, generator=torch.Generator().manual_seed(10 + i)))
    stats = CalibrationStats(hessians=hess, kv_hessian="block")
    source = {n: drafter.model.get_submodule(n).weight.detach().clone() for n in names}
    outcome = quantize_drafter(drafter.model, stats, QuantSettings(bits=2, group_size=32, clip_search=True))
    for n in names:
        want = gptq_quantize(source[n], hess[input_group(n, "block")].hessian(), QuantSpec(2, 32), clip=True)
        assert torch.equal(outcome.weights[n].codes, want.codes) and torch.equal(outcome.weights[n].scales, want.scales)
    # RTN has no Hessian to weigh the search: the flag is dropped, as act-order is
    assert not QuantSettings(method="rtn", clip_search=True).normalized().clip_search
