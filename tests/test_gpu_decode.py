"""The decode loop on CUDA (needs a CUDA GPU: `pytest -m gpu tests/test_gpu_decode.py`)."""

import pytest
import torch

from dflash_quant.speculative.batch_decode import batched_speculative_generate
from dflash_quant.speculative.decode import speculative_generate

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
FIELDS = ("tokens", "accepted", "drafted", "acceptance_lengths", "target_forwards", "drafter_forwards")


def _pair(device, dtype=torch.float32):
    from dflash_quant.loading.drafter import load_drafter
    from dflash_quant.loading.runtime import default_prompt_spec, encode_prompts, resolve_device, stop_tokens
    from dflash_quant.loading.target import load_target

    dev = resolve_device(device)  # on CUDA also sets the attention backends the CLI uses
    target = load_target("reference:target", device=dev, dtype=dtype)
    prompts = encode_prompts(target, default_prompt_spec(target, "heldout"), 12, True, 48, "a", "b")
    return load_drafter("reference", device=dev, dtype=dtype).model, target.model, prompts, stop_tokens(target)


def test_fp32_batched_rows_equal_one_by_one_on_cuda():
    drafter, target, prompts, stops = _pair("cuda")
    seq = [
        speculative_generate(drafter, target, torch.tensor([p], device="cuda"), 48, stop_token_ids=stops)
        for p in prompts
    ]
    got = []
    for i in range(0, len(prompts), 5):
        got += batched_speculative_generate(drafter, target, prompts[i : i + 5], 48, stops)
    assert [{f: getattr(r, f) for f in FIELDS} for r in got] == [{f: getattr(r, f) for f in FIELDS} for r in seq]


def test_drafter_on_cuda_matches_cpu():
    # On CUDA the drafter repeats its key/value heads for the memory-efficient kernel; on CPU it uses GQA.
    cpu, _, _, _ = _pair("cpu")
    gpu, _, _, _ = _pair("cuda")
    g = torch.Generator().manual_seed(0)
    h = cpu.config.hidden_size
    noise = torch.randn(2, 8, h, generator=g)
    ctx = torch.randn(2, 20, h * len(cpu.target_layer_ids), generator=g)
    pos = torch.arange(28)[None]
    want = cpu(noise, ctx, pos)
    got = gpu(noise.cuda(), ctx.cuda(), pos.cuda()).cpu()
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
