"""The batched GPTQ solver gives exactly the textbook's result per matrix (CPU fp32; the Triton kernel is
compared code by code on the GPU in benchmarks/bench_gptq.py and by the gpu-marked test below)."""

import warnings

import pytest
import torch

from dflash_quant.calibration.hessian import HessianAccumulator
from dflash_quant.errors import UsageError
from dflash_quant.quantize.gptq import GPTQFallbackWarning, gptq_quantize, gptq_quantize_shared
from dflash_quant.quantize.gptq_batched import gptq_quantize_groups, gptq_quantize_many
from dflash_quant.quantize.spec import QuantSpec


def _hessian(width, rows, seed, dead=()):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, width, generator=g) @ torch.randn(width, width, generator=g) / width**0.5
    x = x * torch.logspace(-1, 1, width)[torch.randperm(width, generator=g)] + 0.05 * torch.randn(
        rows, width, generator=g
    )
    for d in dead:
        x[:, d] = 0
    acc = HessianAccumulator(width)
    acc.add(x)
    return acc.hessian()


def _same(a, b):
    assert torch.equal(a.codes, b.codes), f"{(a.codes != b.codes).sum()} codes differ"
    assert torch.equal(a.g_idx, b.g_idx)
    assert torch.equal(a.zeros, b.zeros)
    assert torch.equal(a.scales, b.scales)
    assert a.damp_used == b.damp_used and a.fallback == b.fallback and a.name == b.name
    assert (a.desc_act, a.static_groups) == (b.desc_act, b.static_groups)


CASES = [
    # bits, group, sym, desc_act, static, block: dynamic groups inside a block, spanning blocks, per row
    (4, 16, True, False, False, 32),
    (4, 32, False, True, False, 16),  # group wider than the block: parameters from the pending columns
    (3, 48, True, False, False, 32),  # groups start inside a block and run past it
    (2, 16, False, True, True, 32),  # act-order with static groups
    (8, -1, True, True, False, 32),
    (4, -1, False, False, False, 64),
]


@pytest.mark.parametrize("bits,group,sym,desc_act,static,block", CASES)
def test_batched_equals_textbook_per_matrix(bits, group, sym, desc_act, static, block):
    spec = QuantSpec(bits, group, sym)
    torch.manual_seed(bits * 100 + max(group, 0))
    problems = []
    for k, (out, width) in enumerate([(40, 96), (24, 96), (40, 96), (8, 96), (40, 144), (40, 96)]):
        dead = (3, 50) if k == 2 else ()
        problems.append((torch.randn(out, width) * 0.1, _hessian(width, 300, k, dead), f"m{k}"))
    kw = dict(desc_act=desc_act, static_groups=static, block_size=block)
    if (group != -1) and 144 % group:
        problems = [p for p in problems if p[0].shape[1] != 144]
    got = gptq_quantize_many(problems, spec, kernel="torch", **kw)
    for (w, h, name), qw in zip(problems, got, strict=False):
        _same(qw, gptq_quantize(w, h, spec, name=name, **kw))


def test_batches_split_by_memory_cap_give_the_same_result():
    spec = QuantSpec(4, 32, True)
    problems = [(torch.randn(32, 64), _hessian(64, 200, k), f"m{k}") for k in range(4)]
    whole = gptq_quantize_many(problems, spec, kernel="torch")
    split = gptq_quantize_many(problems, spec, kernel="torch", max_batch_bytes=1)  # one matrix per batch
    for a, b in zip(whole, split, strict=False):
        _same(a, b)


def test_groups_equal_shared_input_passes():
    spec = QuantSpec(4, 32, True)
    groups = []
    for layer in range(3):
        h = _hessian(64, 256, layer)
        groups.append(
            (
                [torch.randn(48, 64), torch.randn(16, 64), torch.randn(16, 64)],
                h,
                [f"l{layer}.q", f"l{layer}.k", f"l{layer}.v"],
            )
        )
        groups.append(([torch.randn(64, 64)], _hessian(64, 256, 10 + layer), [f"l{layer}.o"]))
    got = gptq_quantize_groups(groups, spec, kernel="torch", desc_act=True)
    for (ws, h, names), qws in zip(groups, got, strict=False):
        want = gptq_quantize_shared(ws, h, spec, names=names, desc_act=True)
        assert [q.name for q in qws] == names
        for a, b in zip(qws, want, strict=False):
            _same(a, b)
            assert a.codes.untyped_storage().data_ptr() != qws[0].codes.untyped_storage().data_ptr() or a is qws[0]


def test_hopeless_hessian_falls_back_to_rtn_like_the_textbook():
    spec = QuantSpec(4, 32, True)
    w = torch.randn(16, 64)
    bad = -torch.eye(64)  # negative definite: every damp fails
    good = _hessian(64, 200, 1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", GPTQFallbackWarning)
        got = gptq_quantize_many([(w, bad, "bad"), (w, good, "good")], spec, kernel="torch")
    assert any("bad" in str(c.message) for c in caught)
    assert {c.filename for c in caught if issubclass(c.category, GPTQFallbackWarning)} == {__file__}  # the caller
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", GPTQFallbackWarning)
        _same(got[0], gptq_quantize(w, bad, spec, name="bad"))
    _same(got[1], gptq_quantize(w, good, spec, name="good"))
    assert got[0].fallback and got[1].fallback is None


def test_bad_kernel_name_and_triton_on_cpu_are_refused():
    spec = QuantSpec(4, 32, True)
    problem = [(torch.randn(8, 64), _hessian(64, 100, 0), "m")]
    with pytest.raises(UsageError, match="kernel must be one of"):
        gptq_quantize_many(problem, spec, kernel="cuda")
    with pytest.raises(UsageError, match="needs a CUDA device"):
        gptq_quantize_many(problem, spec, kernel="triton")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("bits,group,sym,desc_act,static,block", CASES + [(4, 128, True, False, False, 128)])
def test_triton_kernel_equals_textbook_on_cuda(bits, group, sym, desc_act, static, block):
    spec = QuantSpec(bits, group, sym)
    torch.manual_seed(1)
    problems = [(torch.randn(200, 384, device="cuda") * 0.05, _hessian(384, 900, k).cuda(), f"m{k}") for k in range(3)]
    kw = dict(desc_act=desc_act, static_groups=static, block_size=block)
    if group != -1 and 384 % group:
        pytest.skip("group does not divide 384")
    got = gptq_quantize_many(problems, spec, kernel="triton", **kw)
    for (w, h, name), qw in zip(problems, got, strict=False):
        _same(qw, gptq_quantize(w, h, spec, name=name, **kw))


def test_drafter_solve_in_memory_bounded_chunks_and_on_cpu_gives_the_same_codes():
    """At the 27B scale every group's fp32 weights and Hessian copies at once do not fit beside the target: the
    drafter's groups are solved in chunks within a byte budget, a group larger than the budget alone on the CPU,
    with the same codes as one unbounded solve."""
    import copy

    from dflash_quant.calibration.capture import input_group
    from dflash_quant.models.config import parse_draft_config
    from dflash_quant.models.model2 import build_drafter
    from dflash_quant.quantize.drafter import QuantOutcome, _apply, _group_bytes, solve_plan
    from dflash_quant.quantize.settings import QuantSettings
    from tests.tiny import drafter_raw_config

    torch.manual_seed(0)
    model = build_drafter(parse_draft_config(drafter_raw_config())).eval()
    names = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"]
    accs: dict[str, HessianAccumulator] = {}
    groups = {}
    for name in names:
        g = input_group(name, "block")
        module = model.get_submodule(name)
        if g not in accs:
            accs[g] = HessianAccumulator(module.in_features, name=g)
            accs[g].add(torch.randn(64, module.in_features))
        groups.setdefault(g, ([], [], accs[g]))
        groups[g][0].append(name)
        groups[g][1].append(module)
    pending = list(groups.values())
    sizes = [_group_bytes(m) for _, m, _ in pending]
    budget = max(sizes) - 1  # the largest groups exceed it: solved on the CPU; the rest in several chunks
    plan = solve_plan(pending, budget)
    assert sum(on_cpu for _, on_cpu in plan) == sum(s > budget for s in sizes) >= 1
    assert sum(1 for _, on_cpu in plan if not on_cpu) >= 2
    assert all(sum(_group_bytes(g[1]) for g in chunk) <= budget for chunk, on_cpu in plan if not on_cpu)
    assert sorted(n for chunk, _ in plan for g in chunk for n in g[0]) == sorted(names)
    assert solve_plan(pending, None) == [(pending, False)]

    settings = QuantSettings(bits=3, group_size=32, min_rows=16)
    results = {}
    for limit in (None, budget):
        m2 = copy.deepcopy(model)
        own = [(ns, [m2.get_submodule(n) for n in ns], acc) for ns, _, acc in pending]
        out = QuantOutcome(weights={}, kept=[])
        _apply(own, settings, out, None, budget=limit)
        results[limit] = (out, m2)
    (a, ma), (b, mb) = results[None], results[budget]
    assert [x["name"] for x in a.layers] == [x["name"] for x in b.layers]  # written back in the same order
    for name in names:
        qa, qb = a.weights[name], b.weights[name]
        assert torch.equal(qa.codes, qb.codes) and torch.equal(qa.scales, qb.scales)
        assert torch.equal(ma.get_submodule(name).weight, mb.get_submodule(name).weight)


def test_the_gpu_solve_budget_stays_within_a_per_process_cap():
    """On an 80 GB card capped at 22 GB (--gpu-memory-limit) with 19 GB held, GPTQ's solve (80 % of it) and the
    batch sizes see the 3 GB left, not the card's free 60 GB, which would grow the run past the card it emulates."""
    from dflash_quant.models.gpu import room

    gb = 10**9
    assert room(60 * gb, 80 * gb, 1.0, 19 * gb) == 60 * gb
    assert room(60 * gb, 80 * gb, 22 / 80, 19 * gb) == 3 * gb
    assert room(2 * gb, 80 * gb, 22 / 80, 19 * gb) == 2 * gb  # the device's free, if less
    assert room(60 * gb, 80 * gb, 22 / 80, 23 * gb) == 0  # over the cap already: every group on the CPU


def test_a_gpu_memory_limit_on_a_run_that_found_no_gpu_is_refused():
    """--device auto on a machine without CUDA resolves to the CPU: the cap is refused, not silently ignored."""
    from dflash_quant.errors import UsageError
    from dflash_quant.pipeline.stages import cap_gpu_memory

    with pytest.raises(UsageError, match=r"--gpu-memory-limit caps a GPU, and this run is on cpu"):
        cap_gpu_memory(torch.device("cpu"), 20 << 30)


@pytest.mark.parametrize(("device", "index"), [("cuda", 1), ("cuda:0", 0)])
def test_a_gpu_memory_limit_on_a_bare_cuda_device_caps_the_current_gpu(monkeypatch, device, index):
    """`--device cuda` resolves to a device without an index, which torch's set_per_process_memory_fraction
    refuses with a traceback (the 27B capped run died on it): the cap goes to the current GPU's index."""
    from dflash_quant.pipeline.stages import cap_gpu_memory

    calls = []
    props = type("Props", (), {"total_memory": 80 << 30})
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: calls.append(("props", i)) or props)
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, i: calls.append(("cap", f, i)))
    cap_gpu_memory(torch.device(device), 20 << 30)
    assert calls == [("props", index), ("cap", 0.25, index)]
    assert all(isinstance(c[-1], int) for c in calls)
