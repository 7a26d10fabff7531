"""Record golden outputs of the official z-lab DFlash implementation (PyPI ``dflash==0.1.0``).

Runs ONLY inside the isolated environment ``.venv-official`` (it pins transformers 5.15):

    python3 -m venv .venv-official
    .venv-official/bin/pip install torch==2.13.0 "dflash[local]==0.1.0"
    .venv-official/bin/python scripts/make_official_golden.py            # tiny mode (default)
    .venv-official/bin/python scripts/make_official_golden.py dflash2    # DFlash2 drafter on the tiny target
    .venv-official/bin/python scripts/make_official_golden.py --pair DIR --prompts FILE.jsonl --out OUTDIR

Everything runs on CPU in fp32 with fixed seeds. See tests/fixtures/official/README.md for what the
files mean; tests/test_official_parity.py compares our implementation against them.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from importlib import metadata
from pathlib import Path

import dflash.model as dm
import torch
import torch.nn.functional as F
from dflash.model import DFlash2DraftModel, DFlashDraftModel, dflash_generate, extract_context_feature
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

# The official timer calls torch.cuda.synchronize(); on CPU use the plain clock.
dm._cuda_time = time.perf_counter

REPO = Path(__file__).resolve().parents[1]
TINY_DIR = REPO / "tests" / "fixtures" / "official" / "tiny"
DFLASH2_DIR = TINY_DIR / "dflash2"

VOCAB = 512
HIDDEN = 64
MASK_ID = 511  # an unused row of the target's embedding table, like Qwen3's <|MASK|>
EOS_ID = 2
TARGET_LAYERS = 4
MAX_NEW_TOKENS = 48


def versions() -> dict:
    out = {"python": sys.version.split()[0]}
    for name in ("dflash", "transformers", "torch", "safetensors", "tokenizers"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


# ---------------------------------------------------------------------------
# tiny models
# ---------------------------------------------------------------------------


def tiny_target_config() -> Qwen3Config:
    return Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=128,
        num_hidden_layers=TARGET_LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=False,
        initializer_range=0.05,  # embeddings and head are rescaled in make_target()
        bos_token_id=1,
        eos_token_id=EOS_ID,
        pad_token_id=0,
    )


def make_target() -> Qwen3ForCausalLM:
    """A random target that behaves mostly like a bigram model with some context dependence: a large input
    embedding (std 1) against small decoder layers (std 0.05) makes the residual stream dominated by the
    current token, so greedy decoding falls into short cycles after a few tokens (a random target with
    default init is chaotic and no drafter can follow it). The head is scaled up (std 1) only to widen
    the top-1/top-2 logit margins; a positive scale of the head never changes a greedy choice."""
    target = Qwen3ForCausalLM(tiny_target_config()).eval()
    with torch.no_grad():
        target.model.embed_tokens.weight.mul_(20.0)
        target.lm_head.weight.mul_(20.0)
    return target


def drafter_config(kind: str) -> Qwen3Config:
    common = dict(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=False,
        initializer_range=0.08,
        num_target_layers=TARGET_LAYERS,
        architectures=["DFlashDraftModel"],
    )
    if kind == "full":
        # explicit dflash_config; block_size top-level (as in the z-lab releases)
        return Qwen3Config(
            **common,
            block_size=8,
            dflash_config={"mask_token_id": MASK_ID, "target_layer_ids": [0, 2]},
        )
    if kind == "swa":
        # layer_types with a sliding layer, no is_causal key (-> sliding layers are causal),
        # no target_layer_ids (-> published fallback build_target_layer_ids(4, 2) == [1, 1]),
        # block_size and mask_token_id top-level.
        # use_sliding_window=True is needed: transformers' Qwen3Config sets sliding_window=None otherwise.
        return Qwen3Config(
            **common,
            block_size=4,
            mask_token_id=MASK_ID,
            use_sliding_window=True,
            sliding_window=6,
            max_window_layers=0,
            layer_types=["sliding_attention", "full_attention"],
        )
    raise ValueError(kind)


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<pad>": 0, "<bos>": 1, "<eos>": EOS_ID, "<unk>": 3}
    for i in range(4, VOCAB - 1):
        vocab[f"w{i}"] = i
    vocab["<|MASK|>"] = MASK_ID
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>", unk_token="<unk>"
    )


@torch.no_grad()
def plain_greedy(target, ids: list[int], max_new_tokens: int, stop_ids: list[int] | None = None):
    """The target's own greedy output: full recompute every step, no cache. Also the smallest top1-top2 margin."""
    seq = torch.tensor([ids])
    out, margin = [], float("inf")
    for _ in range(max_new_tokens):
        logits = target(seq).logits[0, -1]
        top = torch.topk(logits, 2).values
        margin = min(margin, float(top[0] - top[1]))
        nxt = int(logits.argmax())
        out.append(nxt)
        seq = torch.cat([seq, torch.tensor([[nxt]])], dim=1)
        if stop_ids and nxt in stop_ids:
            break
    return out, margin


def taps(target, drafter, seq: torch.Tensor) -> torch.Tensor:
    hs = target(seq, output_hidden_states=True).hidden_states
    return extract_context_feature(hs, drafter.target_layer_ids)


def train_drafter(drafter: DFlashDraftModel, target, seqs: torch.Tensor, prompt_len: int, steps: int, seed: int):
    """A few hundred Adam steps of the DFlash objective on the target's own greedy continuations, so the
    random pair has non-trivial acceptance. The target stays frozen (its embedding and head are used)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        feats = taps(target, drafter, seqs)
        emb = target.get_input_embeddings().weight
    head = target.lm_head
    B = drafter.block_size
    opt = torch.optim.Adam(drafter.parameters(), lr=3e-3)
    drafter.train()
    n, total = seqs.shape
    for step in range(steps):
        rows = torch.randint(0, n, (32,), generator=g)
        s = int(torch.randint(prompt_len, total - B + 1, (1,), generator=g))
        block = seqs[rows, s : s + B].clone()
        labels = block[:, 1:].clone()
        block[:, 1:] = MASK_ID
        noise = F.embedding(block, emb)
        pos = torch.arange(s + B)[None].expand(len(rows), -1)
        h = drafter(position_ids=pos, noise_embedding=noise, target_hidden=feats[rows, :s])
        logits = head(h[:, 1:])
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 100 == 0 or step == steps - 1:
            print(f"  train step {step}: loss {loss.item():.3f}", file=sys.stderr)
    drafter.eval()
    return float(loss.item())


def _mid_step(acc: list[int], i: int) -> bool:
    """Whether new-token index i (index 0 comes from the prefill) lies inside, not at the end of, a step > 1."""
    pos = 1
    for a in acc:
        if pos <= i < pos + a:
            return a > 1 and i < pos + a - 1
        pos += a
    return False


def pick_stop(golden: dict) -> tuple[int, int]:
    fallback = None
    for j, out in enumerate(golden["target_greedy"]):
        for i, t in enumerate(out):
            if i == 0 or t in out[:i]:
                continue
            mids = [_mid_step(d["generate"][j]["acceptance_lengths"], i) for d in golden["drafters"].values()]
            if all(mids):
                return j, t
            if mids[0] and fallback is None:
                fallback = (j, t)
    if fallback is None:
        raise RuntimeError("no stop token lands inside an accepted step; change the seeds")
    return fallback


def run_generate(drafter, target, ids: list[int], max_new_tokens: int, stop_ids):
    r = dflash_generate(
        drafter,
        target,
        torch.tensor([ids]),
        max_new_tokens=max_new_tokens,
        stop_token_ids=stop_ids,
        temperature=0.0,
        return_stats=True,
    )
    new = r.output_ids[0, len(ids) :].tolist()
    acc = [int(a) for a in r.acceptance_lengths]
    tau = sum(acc) / len(acc) if acc else None
    return {"new_tokens": new, "acceptance_lengths": acc, "tau": tau}


@torch.no_grad()
def record_forward(drafter, target, name: str, seq: list[int], ctx: int, ctx2: int, tensors: dict) -> dict:
    """(i) one forward without cache; (ii) two calls through the official DynamicCache, as in dflash_generate."""
    B = drafter.block_size
    scale = float(dm._draft_value(drafter.config, "input_embedding_scale", 1.0))
    full = taps(target, drafter, torch.tensor([seq]))  # [1, len(seq), n_taps*H]

    def noise_for(anchor: int) -> torch.Tensor:
        ids = torch.full((1, B), drafter.mask_token_id, dtype=torch.long)
        ids[0, 0] = anchor
        return dm._raw_input_embeddings(target, ids, scale)

    head = dm._output_head(target)
    # (i) no cache: context = taps of positions [0, ctx), block = [seq[ctx], MASK...] at positions [ctx, ctx+B)
    th = full[:, :ctx].contiguous()
    noise = noise_for(seq[ctx])
    pos = torch.arange(ctx + B)[None]
    out = drafter(position_ids=pos, noise_embedding=noise, target_hidden=th)
    p = f"{name}/forward/"
    tensors |= {
        p + "target_hidden": th,
        p + "noise_embedding": noise,
        p + "position_ids": pos,
        p + "hidden": out,
        p + "logits": drafter.compute_logits(out, head),
    }
    # (ii) two calls with the official cache: exactly the call pattern of dflash_generate
    cache = dm._make_cache(drafter.config)
    out1 = drafter(position_ids=pos, noise_embedding=noise, target_hidden=th, past_key_values=cache, use_cache=True)
    dm._crop_to(cache, ctx)
    start = ctx + ctx2
    th2 = full[:, ctx:start].contiguous()
    noise2 = noise_for(seq[start])
    pos2 = torch.arange(ctx, start + B)[None]
    out2 = drafter(position_ids=pos2, noise_embedding=noise2, target_hidden=th2, past_key_values=cache, use_cache=True)
    dm._crop_to(cache, start)
    p = f"{name}/cached/"
    tensors |= {
        p + "call1/hidden": out1,  # call 1 inputs are {name}/forward/{target_hidden,noise_embedding,position_ids}
        p + "call2/target_hidden": th2,
        p + "call2/noise_embedding": noise2,
        p + "call2/position_ids": pos2,
        p + "call2/hidden": out2,
        p + "call2/logits": drafter.compute_logits(out2, head),
    }
    return {
        "sequence": seq[: start + 1],
        "ctx_len": ctx,
        "ctx2_len": ctx2,
        "block_size": B,
        "cache_len_after_call2": int(cache.get_seq_length()),
        "max_abs_call1_minus_no_cache": float((out1 - out).abs().max()),
    }


def make_tiny(out_dir: Path, train_steps: int) -> None:
    torch.manual_seed(0)
    torch.set_num_threads(1)  # deterministic CPU reductions for the short training run
    out_dir.mkdir(parents=True, exist_ok=True)

    target = make_target()
    tok = tiny_tokenizer()

    # golden prompts: random token ids (no specials, no MASK)
    g = torch.Generator().manual_seed(1234)
    prompts = [torch.randint(4, MASK_ID, (n,), generator=g).tolist() for n in (10, 16, 7, 24)]

    # training sequences for the drafters: other random prompts + the target's greedy continuation
    n_train, plen, gen = 192, 12, 56
    tp = torch.randint(4, MASK_ID, (n_train, plen), generator=g)
    with torch.no_grad():
        seqs = tp
        for _ in range(gen):
            nxt = target(seqs).logits[:, -1].argmax(-1, keepdim=True)
            seqs = torch.cat([seqs, nxt], dim=1)

    golden: dict = {"mode": "tiny", "versions": versions(), "max_new_tokens": MAX_NEW_TOKENS, "drafters": {}}
    tensors: dict[str, torch.Tensor] = {}

    plain = [plain_greedy(target, p, MAX_NEW_TOKENS) for p in prompts]
    golden["prompts"] = prompts
    golden["target_greedy"] = [t for t, _ in plain]
    golden["target_greedy_min_margin"] = [m for _, m in plain]
    target.save_pretrained(out_dir / "target", safe_serialization=True)
    tok.save_pretrained(out_dir / "target")

    models = {}
    for i, kind in enumerate(("full", "swa")):
        name = f"drafter_{kind}"
        torch.manual_seed(100 + i)
        drafter = DFlashDraftModel(drafter_config(kind)).eval()
        print(f"{name}: target_layer_ids={drafter.target_layer_ids} block_size={drafter.block_size}", file=sys.stderr)
        loss = train_drafter(drafter, target, seqs, plen, train_steps, seed=200 + i) if train_steps else None
        drafter.save_pretrained(out_dir / name, safe_serialization=True)

        entry = {
            "path": name,
            "block_size": drafter.block_size,
            "mask_token_id": drafter.mask_token_id,
            "target_layer_ids": list(drafter.target_layer_ids),
            "train_steps": train_steps,
            "final_train_loss": loss,
        }
        # forward goldens on the target's own continuation of prompt 1 (ctx 12 > sliding window 6)
        seq = prompts[1] + golden["target_greedy"][1]
        entry["forward"] = record_forward(drafter, target, name, seq, ctx=12, ctx2=3, tensors=tensors)
        entry["generate"] = [run_generate(drafter, target, p, MAX_NEW_TOKENS, None) for p in prompts]
        for j, r in enumerate(entry["generate"]):
            if r["new_tokens"] != golden["target_greedy"][j]:
                print(f"WARNING {name} prompt {j}: official output differs from plain greedy", file=sys.stderr)
        print(f"{name}: tau per prompt {[round(r['tau'], 3) for r in entry['generate']]}", file=sys.stderr)
        golden["drafters"][name] = entry
        models[name] = drafter

    # stop run: a stop token whose first occurrence falls strictly inside a multi-token accepted step of
    # both drafters, so the official truncation of that step is exercised
    stop_prompt, stop_id = pick_stop(golden)
    golden["stop"] = {"prompt_index": stop_prompt, "stop_token_ids": [stop_id]}
    golden["target_greedy_stop"] = plain_greedy(target, prompts[stop_prompt], MAX_NEW_TOKENS, [stop_id])[0]
    for name, drafter in models.items():
        r = run_generate(drafter, target, prompts[stop_prompt], MAX_NEW_TOKENS, [stop_id])
        golden["drafters"][name]["generate_stop"] = r
        if r["new_tokens"] != golden["target_greedy_stop"]:
            print(f"WARNING {name} stop run differs from plain greedy", file=sys.stderr)
        print(f"{name}: stop run acceptance {r['acceptance_lengths']}", file=sys.stderr)

    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out_dir / "golden.safetensors"))
    (out_dir / "golden.json").write_text(json.dumps(golden, indent=1) + "\n")

    # a small prompt file + the --pair layout, used to check the pair mode on these tiny models
    prompt_file = out_dir / "pair_prompts.jsonl"
    with prompt_file.open("w") as f:
        for j, p in enumerate(prompts[:2]):
            f.write(json.dumps({"id": f"tiny-{j}", "prompt": " ".join(f"w{t}" for t in p)}) + "\n")
    print(f"wrote {out_dir}", file=sys.stderr)


# ---------------------------------------------------------------------------
# dflash2 mode: a DFlash2 drafter (conv + candidate selector) on the tiny full-attention target
# ---------------------------------------------------------------------------

CODEBOOKS = ("predecessor_codebook", "successor_codebook")


def dflash2_config() -> Qwen3Config:
    """The Qwen3.8-27B-DFlash2 layout scaled down: block 8, every layer sliding-window with is_causal false,
    the four DFlash2 keys inside dflash_config. The window (6) is shorter than the context of most steps
    and than the block, so the sliding cache trimming is exercised."""
    return Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=False,
        initializer_range=0.08,
        num_target_layers=TARGET_LAYERS,
        architectures=["DFlash2DraftModel"],
        block_size=8,
        use_sliding_window=True,
        sliding_window=6,
        max_window_layers=0,
        layer_types=["sliding_attention", "sliding_attention"],
        is_causal=False,
        dflash_config={
            "mask_token_id": MASK_ID,
            "target_layer_ids": [0, 2],
            "conv_kernel_size": 3,
            "conv_group_size": 16,
            "selector_rank": 16,
            "selector_top_k": 8,
        },
    )


def init_dflash2(drafter: DFlash2DraftModel) -> None:
    """The official base_kernel is torch.empty and post_init leaves it alone: start near the identity
    convolution (tap 0 = 1) with some noise, and give the dynamic part and the codebooks a visible size."""
    with torch.no_grad():
        for layer in drafter.layers:
            for conv in (layer.attention_conv, layer.mlp_conv):
                conv.base_kernel.normal_(std=0.15)
                conv.base_kernel[:, 0].add_(1.0)
                conv.kernel_projection.weight.normal_(std=0.1)
        sel = drafter.candidate_selector
        for name in CODEBOOKS:
            getattr(sel, name).weight.normal_(std=0.5)
        sel.hidden_projection.weight.normal_(std=0.2)


def train_dflash2(drafter, target, seqs: torch.Tensor, prompt_len: int, steps: int, seed: int) -> float:
    """As train_drafter, plus the selector: cross-entropy over each slot's top-k candidates with the true
    previous token as predecessor (teacher forcing), on slots whose label is among the candidates."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        feats = taps(target, drafter, seqs)
        emb = target.get_input_embeddings().weight
    head, sel = target.lm_head, drafter.candidate_selector
    B = drafter.block_size
    opt = torch.optim.Adam(drafter.parameters(), lr=3e-3)
    drafter.train()
    n, total = seqs.shape
    for step in range(steps):
        rows = torch.randint(0, n, (32,), generator=g)
        s = int(torch.randint(prompt_len, total - B + 1, (1,), generator=g))
        block = seqs[rows, s : s + B].clone()
        labels = block[:, 1:].clone()
        prev = block[:, :-1].clone()
        block[:, 1:] = MASK_ID
        noise = F.embedding(block, emb)
        pos = torch.arange(s + B)[None].expand(len(rows), -1)
        h = drafter(position_ids=pos, noise_embedding=noise, target_hidden=feats[rows, :s])[:, 1:]
        logits = drafter.compute_logits(h, head)
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))
        unary, cand = torch.topk(logits, sel.top_k, dim=-1)
        scores = unary + torch.einsum(
            "bgr,bgkr->bgk", sel.predecessor_codebook(prev) * sel.hidden_projection(h), sel.successor_codebook(cand)
        )
        hit = cand == labels[..., None]
        keep = hit.any(-1)
        if keep.any():
            loss = loss + F.cross_entropy(scores[keep], hit[keep].float().argmax(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 100 == 0 or step == steps - 1:
            print(f"  train step {step}: loss {loss.item():.3f}", file=sys.stderr)
    drafter.eval()
    return float(loss.item())


def save_release_layout(drafter: DFlash2DraftModel, out: Path) -> None:
    """save_pretrained, then rename the codebook keys to the release layout (no `.weight`), which the
    official from_pretrained maps back; reloading must give the same tensors."""
    drafter.save_pretrained(out, safe_serialization=True)
    files = sorted(out.glob("*.safetensors"))
    assert len(files) == 1, files
    state = load_file(str(files[0]))
    renamed = {}
    for key, value in state.items():
        for name in CODEBOOKS:
            if key == f"candidate_selector.{name}.weight":
                key = f"candidate_selector.{name}"
        renamed[key] = value.contiguous()
    assert all(f"candidate_selector.{n}" in renamed for n in CODEBOOKS), sorted(renamed)
    save_file(renamed, str(files[0]), metadata={"format": "pt"})
    again = DFlash2DraftModel.from_pretrained(out, dtype=torch.float32).eval()
    mine, theirs = drafter.state_dict(), again.state_dict()
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine), "reload differs"


def make_dflash2(out_dir: Path, train_steps: int) -> None:
    """Needs the tiny fixture (tiny/target, tiny/golden.json) made by the default mode."""
    torch.manual_seed(0)
    torch.set_num_threads(1)
    out_dir.mkdir(parents=True, exist_ok=True)
    base = json.loads((TINY_DIR / "golden.json").read_text())
    prompts = base["prompts"]
    target = AutoModelForCausalLM.from_pretrained(TINY_DIR / "target", dtype=torch.float32).eval()

    # the same training sequences as tiny mode: the prompts consume the generator first
    g = torch.Generator().manual_seed(1234)
    for n in (10, 16, 7, 24):
        torch.randint(4, MASK_ID, (n,), generator=g)
    n_train, plen, gen = 192, 12, 56
    with torch.no_grad():
        seqs = torch.randint(4, MASK_ID, (n_train, plen), generator=g)
        for _ in range(gen):
            seqs = torch.cat([seqs, target(seqs).logits[:, -1].argmax(-1, keepdim=True)], dim=1)

    torch.manual_seed(300)
    drafter = DFlash2DraftModel(dflash2_config()).eval()
    init_dflash2(drafter)
    loss = train_dflash2(drafter, target, seqs, plen, train_steps, seed=400) if train_steps else None
    save_release_layout(drafter, out_dir / "drafter")
    # from here on, the reloaded release-layout checkpoint is what gets recorded
    drafter = DFlash2DraftModel.from_pretrained(out_dir / "drafter", dtype=torch.float32).eval()

    tensors: dict[str, torch.Tensor] = {}
    entry = {
        "block_size": drafter.block_size,
        "mask_token_id": drafter.mask_token_id,
        "target_layer_ids": list(drafter.target_layer_ids),
        "train_steps": train_steps,
        "final_train_loss": loss,
    }
    seq = prompts[1] + base["target_greedy"][1]
    entry["forward"] = record_forward(drafter, target, "dflash2", seq, ctx=12, ctx2=3, tensors=tensors)
    with torch.no_grad():  # the selector's greedy walk on the no-cache forward (rows 1.., anchor seq[12])
        hidden = tensors["dflash2/forward/hidden"][:, 1:]
        tokens, cands, q = drafter.propose(hidden, torch.tensor([seq[12]]), dm._output_head(target), 0.0)
        assert q is None
        tensors["dflash2/propose/tokens"] = tokens
        tensors["dflash2/propose/candidates"] = cands
        argmax = drafter.compute_logits(hidden, dm._output_head(target)).argmax(-1)
        entry["propose_differs_from_argmax"] = int((tokens != argmax).sum())
    entry["generate"] = [run_generate(drafter, target, p, MAX_NEW_TOKENS, None) for p in prompts]
    for j, r in enumerate(entry["generate"]):
        if r["new_tokens"] != base["target_greedy"][j]:
            print(f"WARNING dflash2 prompt {j}: official output differs from plain greedy", file=sys.stderr)
    print(f"dflash2: tau per prompt {[round(r['tau'], 3) for r in entry['generate']]}", file=sys.stderr)
    golden = {
        "mode": "dflash2",
        "versions": versions(),
        "max_new_tokens": MAX_NEW_TOKENS,
        "prompts": prompts,
        "target_greedy": base["target_greedy"],
        "drafter": entry,
    }
    stop_prompt, stop_id = pick_stop({"target_greedy": base["target_greedy"], "drafters": {"dflash2": entry}})
    golden["stop"] = {"prompt_index": stop_prompt, "stop_token_ids": [stop_id]}
    golden["target_greedy_stop"] = plain_greedy(target, prompts[stop_prompt], MAX_NEW_TOKENS, [stop_id])[0]
    entry["generate_stop"] = run_generate(drafter, target, prompts[stop_prompt], MAX_NEW_TOKENS, [stop_id])
    print(f"dflash2: stop run acceptance {entry['generate_stop']['acceptance_lengths']}", file=sys.stderr)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out_dir / "golden.safetensors"))
    (out_dir / "golden.json").write_text(json.dumps(golden, indent=1) + "\n")
    print(f"wrote {out_dir}", file=sys.stderr)


# ---------------------------------------------------------------------------
# --pair mode
# ---------------------------------------------------------------------------


def make_pair(pair_dir: Path, prompts_file: Path, out: Path, drafter_sub: str, max_new_tokens: int, dtype: str) -> None:
    torch.manual_seed(0)
    dt = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    device = "cuda" if torch.cuda.is_available() and dtype != "float32" else "cpu"
    tok = AutoTokenizer.from_pretrained(pair_dir / "target")
    target = AutoModelForCausalLM.from_pretrained(pair_dir / "target", dtype=dt).to(device).eval()
    drafter = DFlashDraftModel.from_pretrained(pair_dir / drafter_sub, dtype=dt).to(device).eval()
    records = []
    for n, line in enumerate(prompts_file.read_text().splitlines(), 1):
        if not line.strip():
            continue
        row = json.loads(line)
        # plain encoding with the tokenizer's default special tokens, no chat template
        # (the same as dflash_quant.prompts.encode_prompt(tok, text, chat_template=False))
        ids = list(tok(row["prompt"])["input_ids"])
        stop = [tok.eos_token_id] if tok.eos_token_id is not None else None
        r = run_generate(drafter, target, ids, max_new_tokens, stop)
        records.append(
            {"id": row.get("id", str(n)), "prompt": row["prompt"], "input_ids": ids, "stop_token_ids": stop, **r}
        )
        print(f"  {records[-1]['id']}: {len(r['new_tokens'])} tokens, tau {r['tau']:.3f}", file=sys.stderr)
    taus = [r["tau"] for r in records if r["tau"] is not None]
    golden = {
        "mode": "pair",
        "versions": versions(),
        "pair_dir": pair_dir.name,
        "drafter": drafter_sub,
        "dtype": dtype,
        "device": device,
        "max_new_tokens": max_new_tokens,
        "temperature": 0.0,
        "chat_template": False,
        "block_size": drafter.block_size,
        "target_layer_ids": list(drafter.target_layer_ids),
        "mean_tau": sum(taus) / len(taus) if taus else None,
        "records": records,
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "golden.json").write_text(json.dumps(golden, indent=1) + "\n")
    print(f"wrote {out / 'golden.json'} (mean tau {golden['mean_tau']})", file=sys.stderr)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "mode",
        nargs="?",
        default="tiny",
        choices=["tiny", "dflash2"],
        help="tiny (default) unless --pair is given; dflash2 needs tiny first",
    )
    ap.add_argument("--out", type=Path, default=None, help="output folder (tiny: the fixture folder)")
    ap.add_argument("--train-steps", type=int, default=400, help="tiny: drafter training steps (0 = random drafters)")
    ap.add_argument("--pair", type=Path, default=None, help="DIR with DIR/target (HF + tokenizer) and DIR/drafter")
    ap.add_argument("--drafter", default="drafter", help="pair: drafter subfolder name")
    ap.add_argument("--prompts", type=Path, default=None, help="pair: jsonl with a 'prompt' field (raw text)")
    ap.add_argument("--max-new-tokens", type=int, default=MAX_NEW_TOKENS)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    a = ap.parse_args(argv)
    if a.pair is not None:
        if a.prompts is None or a.out is None:
            ap.error("--pair needs --prompts and --out")
        make_pair(a.pair, a.prompts, a.out, a.drafter, a.max_new_tokens, a.dtype)
    elif a.mode == "dflash2":
        make_dflash2(a.out or DFLASH2_DIR, a.train_steps)
    else:
        make_tiny(a.out or TINY_DIR, a.train_steps)


if __name__ == "__main__":
    main()
