"""Train the reference target + DFlash drafter pair from scratch, reproducibly, in one command.

    python -m scripts.reference_pair.train --out DIR [--pair dflash|dflash2] [--device cuda] [--corpus DIR] [--smoke]

Steps (all seeded):
1. corpus: Python standard-library sources (``--corpus`` or the running interpreter's), split into train /
   held-out files by a hash of the relative path (scripts/reference_pair/corpus.py);
2. tokenizer: byte-level BPE (the ``tokenizers`` library) on the train split, with ``<|endoftext|>``
   (document separator, eos) and ``<|MASK|>`` (the drafter's mask token) as special tokens;
3. target: a small Qwen3ForCausalLM (tied embeddings) trained on the train split, next-token loss;
4. prompts: ``calibration_prompts.jsonl`` (train split) and ``heldout_prompts.jsonl`` (held-out split),
   code prefixes of a few dozen tokens that start and end at line boundaries;
5. drafter data: the frozen target's own greedy continuations of train-split token windows;
6. drafter: the DFlash recipe - random anchors in the generated part, blocks [anchor, MASK x (B-1)],
   context = target taps of the positions strictly before the anchor, bidirectional attention inside
   the block, many blocks per sequence in one pass through a custom attention mask, cross-entropy through
   the target's frozen head with position weights exp(-(k-1)/gamma); a fraction of blocks is cut short,
   as the decode loop drafts min(B, tokens left) rows at the end of a generation;
7. a held-out acceptance check that replays greedy speculative decoding exactly (greedy decoding is
   lossless, so the committed sequence is the target's greedy continuation and tau follows from the
   drafter's acceptance at the anchors the loop visits).

Writes DIR/target (Qwen3ForCausalLM + tokenizer, bf16), DIR/drafter (official DFlash layout, bf16), the two
prompt files, and DIR/train_log.json. Runs in about 4 minutes on one H200, much longer on CPU. To ship a
new pair, copy DIR's contents into dflash_quant/reference/pair/ (keep its README.md model card up to date).

``--pair dflash2`` trains the second pair (dflash_quant/reference/dflash2_pair/) with the same steps: a hybrid
Qwen3_5ForCausalLM target (Gated DeltaNet linear-attention and full-attention layers) on the first pair's
tokenizer, and a DFlash2 drafter (grouped dynamic causal convolutions, candidate selector) trained with the
DFlash loss plus the selector loss of scripts/reference_pair/dflash2.py; its acceptance check drafts through
the selector's greedy walk, as the decode loop does.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from dflash_quant.reference import PACKAGE_DIR
from scripts.reference_pair.corpus import Document, default_corpus_dir, load_corpus, split_corpus

EOS = "<|endoftext|>"
MASK = "<|MASK|>"
SPECIALS = [EOS, MASK]


@dataclass
class Recipe:
    pair: str = "dflash"  # "dflash2": hybrid target + DFlash2 drafter (dflash2_recipe)
    seed: int = 0
    max_docs: int | None = None  # smoke: subset of the corpus
    # tokenizer
    vocab_size: int = 4096
    # target (Qwen3)
    hidden: int = 256
    target_layers: int = 6
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 64
    target_intermediate: int = 640
    rope_theta: float = 10000.0
    # hybrid target (Qwen3_5ForCausalLM) when set: one entry per layer, linear_attention / full_attention
    target_layer_types: list[str] | None = None
    linear_key_heads: int = 2
    linear_value_heads: int = 4
    target_stop_step: int | None = None  # like draft_stop_step, for the target's schedule
    # tokenizer: None = train one (step 2); a path relative to dflash_quant/reference/ = reuse that tokenizer.json
    tokenizer_file: str | None = None
    max_positions: int = 2048
    target_seq: int = 512
    target_batch: int = 96
    target_steps: int = 2000
    target_lr: float = 2e-3
    target_warmup: int = 200
    target_eval_every: int = 250
    # prompts
    n_calibration: int = 128
    n_heldout: int = 64
    prompt_min_tokens: int = 24
    prompt_max_tokens: int = 64
    # drafter data (target greedy continuations)
    gen_prefix: int = 48
    gen_new: int = 144
    gen_sequences: int = 32768
    gen_batch: int = 2048
    # drafter (DFlash)
    draft_layers: int = 3
    draft_intermediate: int = 512
    block_size: int = 8
    target_layer_ids: list[int] = field(default_factory=lambda: [0, 2, 4])
    draft_batch: int = 64
    anchors_per_seq: int = 32
    draft_steps: int = 5000  # length of the lr schedule
    # The shipped drafter's run was cut here by the H200 time guard (--deadline-min 3.5); stopping at the
    # same step keeps one command reproducing it. None = run the whole schedule.
    draft_stop_step: int | None = 4049
    draft_lr: float = 2e-3
    draft_warmup: int = 200
    gamma: float = 5.0
    short_block_frac: float = 0.15  # blocks cut to 2..B-1 rows, as the loop drafts them near max_new_tokens
    # DFlash2 drafter when conv_kernel_size is set (sliding-window layers, bidirectional inside the block)
    draft_window: int | None = None
    conv_kernel_size: int | None = None
    conv_group_size: int | None = None
    selector_rank: int | None = None
    selector_top_k: int | None = None
    selector_weight: float = 1.0
    # evaluation at the end
    eval_prompts: int = 32
    eval_new_tokens: int = 64


def smoke_recipe() -> Recipe:
    return Recipe(
        max_docs=60,
        vocab_size=512,
        hidden=64,
        target_layers=4,
        heads=2,
        kv_heads=1,
        head_dim=32,
        target_intermediate=128,
        target_seq=128,
        target_batch=16,
        target_steps=60,
        target_warmup=10,
        target_eval_every=30,
        n_calibration=64,
        n_heldout=32,
        gen_prefix=24,
        gen_new=40,
        gen_sequences=64,
        gen_batch=32,
        draft_intermediate=128,
        target_layer_ids=[0, 1, 2],
        draft_batch=8,
        anchors_per_seq=8,
        draft_steps=60,
        draft_stop_step=None,
        draft_warmup=10,
        eval_prompts=4,
        eval_new_tokens=32,
    )


REFERENCE_TOKENIZER = "pair/target/tokenizer.json"  # the first pair's, relative to dflash_quant/reference/


def dflash2_recipe() -> Recipe:
    """The second pair: hybrid target [L, L, F, L, L, F] and a DFlash2 drafter, both models under 16 MB."""
    return Recipe(
        pair="dflash2",
        target_layer_types=["linear_attention", "linear_attention", "full_attention"] * 2,
        target_intermediate=512,
        target_steps=1500,
        tokenizer_file=REFERENCE_TOKENIZER,
        draft_stop_step=None,
        draft_window=256,
        conv_kernel_size=2,
        conv_group_size=64,
        selector_rank=64,
        selector_top_k=16,
    )


def dflash2_smoke_recipe() -> Recipe:
    r = smoke_recipe()
    r.pair = "dflash2"
    r.target_layer_types = ["linear_attention", "full_attention"] * 2
    r.linear_key_heads, r.linear_value_heads = 1, 2
    r.draft_window, r.conv_kernel_size, r.conv_group_size = 64, 2, 32
    r.selector_rank, r.selector_top_k = 16, 8
    return r


class Log:
    def __init__(self, deadline_s: float | None = None) -> None:
        self.t0 = time.perf_counter()
        self.deadline_s = deadline_s  # safety stop for leased machines; None = never
        self.events: list[dict] = []

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def over(self, fraction: float) -> bool:
        return self.deadline_s is not None and self.elapsed() > fraction * self.deadline_s

    def __call__(self, msg: str, **data) -> None:
        elapsed = time.perf_counter() - self.t0
        print(f"[{elapsed:7.1f}s] {msg}", file=sys.stderr, flush=True)
        self.events.append({"t": round(elapsed, 2), "msg": msg, **data})


def seed_all(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)


def lr_at(step: int, total: int, warmup: int, peak: float, floor: float = 0.05) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    frac = (step - warmup) / max(1, total - warmup)
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))


# ---------------------------------------------------------------------------------------------- tokenizer


def train_tokenizer(docs: list[Document], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator((d.text for d in docs), trainer=trainer, length=len(docs))
    return tok


def save_tokenizer(tok, out: Path, max_len: int) -> None:
    """tokenizer.json + a hand-written tokenizer_config.json (stable across transformers versions)."""
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": EOS,
        "pad_token": EOS,
        "mask_token": MASK,
        "bos_token": None,
        "unk_token": None,
        "model_max_length": max_len,
        "clean_up_tokenization_spaces": False,
        "add_prefix_space": False,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    (out / "special_tokens_map.json").write_text(
        json.dumps({"eos_token": EOS, "pad_token": EOS, "mask_token": MASK}, indent=2) + "\n"
    )


# ---------------------------------------------------------------------------------------------- target


def target_config(r: Recipe, eos_id: int):
    if r.target_layer_types:
        from scripts.reference_pair.dflash2 import hybrid_target_config

        return hybrid_target_config(r, eos_id)
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=r.vocab_size,
        hidden_size=r.hidden,
        intermediate_size=r.target_intermediate,
        num_hidden_layers=r.target_layers,
        num_attention_heads=r.heads,
        num_key_value_heads=r.kv_heads,
        head_dim=r.head_dim,
        max_position_embeddings=r.max_positions,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": r.rope_theta},
        tie_word_embeddings=True,
        attention_bias=False,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
        initializer_range=0.02,
    )


def encode_stream(tok, docs: list[Document], eos_id: int) -> torch.Tensor:
    ids: list[int] = []
    for enc in tok.encode_batch([d.text for d in docs]):
        ids.extend(enc.ids)
        ids.append(eos_id)
    return torch.tensor(ids, dtype=torch.long)


def sample_windows(stream: torch.Tensor, n: int, length: int, gen: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, stream.numel() - length, (n,), generator=gen)
    return torch.stack([stream[s : s + length] for s in starts.tolist()])


def autocast(device: torch.device):
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return torch.autocast("cpu", enabled=False)


def make_optimizer(params, lr: float, device: torch.device) -> torch.optim.Optimizer:
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    kwargs = {"fused": True} if device.type == "cuda" else {}
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8, **kwargs)


@torch.no_grad()
def eval_target(model, val: torch.Tensor, device: torch.device) -> float:
    model.eval()
    losses = []
    for i in range(0, val.shape[0], 32):
        x = val[i : i + 32].to(device)
        with autocast(device):
            logits = model(input_ids=x[:, :-1]).logits
        losses.append(F.cross_entropy(logits.float().flatten(0, 1), x[:, 1:].flatten(), reduction="sum").item())
    model.train()
    return sum(losses) / (val.shape[0] * (val.shape[1] - 1))


def train_target(r: Recipe, train: torch.Tensor, heldout: torch.Tensor, eos_id: int, device: torch.device, log: Log):
    from scripts.reference_pair.dflash2 import target_class

    torch.manual_seed(r.seed + 1)
    model = target_class(r)(target_config(r, eos_id)).to(device)
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    log(f"target: {n_params / 1e6:.2f} M parameters", target_params=n_params)
    opt = make_optimizer(list(model.parameters()), r.target_lr, device)
    gen = torch.Generator().manual_seed(r.seed + 2)
    val_gen = torch.Generator().manual_seed(r.seed + 3)
    n_val = 64 if r.max_docs is None else 8
    val = sample_windows(heldout, n_val, min(r.target_seq + 1, heldout.numel() - 1), val_gen)
    best: tuple[float, dict[str, torch.Tensor], int] = (float("inf"), {}, -1)
    t_start = time.perf_counter()
    for step in range(r.target_steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, r.target_steps, r.target_warmup, r.target_lr)
        x = sample_windows(train, r.target_batch, r.target_seq + 1, gen).to(device, non_blocking=True)
        with autocast(device):
            logits = model(input_ids=x[:, :-1]).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), x[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        last = step + 1 == r.target_steps
        if not last and r.target_stop_step is not None and step + 1 == r.target_stop_step:
            log(f"target: stopped at the recipe's target_stop_step {step + 1} of a {r.target_steps}-step schedule")
            last = True
        if not last and log.over(0.4):
            log(f"target: deadline guard stopped training after step {step + 1}", target_truncated=step + 1)
            last = True
        if (step + 1) % r.target_eval_every == 0 or last:
            val_loss = eval_target(model, val, device)
            log(
                f"target step {step + 1}/{r.target_steps} train {loss.item():.3f} held-out {val_loss:.3f}",
                step=step + 1,
                train_loss=loss.item(),
                heldout_loss=val_loss,
                seconds=time.perf_counter() - t_start,
            )
            if val_loss < best[0]:
                best = (val_loss, {k: v.detach().clone() for k, v in model.state_dict().items()}, step + 1)
        if last:
            break
    model.load_state_dict(best[1])
    log(
        f"target: kept step {best[2]} (held-out loss {best[0]:.3f})",
        target_best_step=best[2],
        target_heldout_loss=best[0],
    )
    # Round to bf16 now, so the drafter learns the continuations of the weights that ship.
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


# ---------------------------------------------------------------------------------------------- prompts


def make_prompts(tok, docs: list[Document], n: int, r: Recipe, rng: random.Random, tag: str) -> list[dict]:
    """Code prefixes of prompt_min..prompt_max tokens that start and end at line boundaries."""
    prompts: list[dict] = []
    seen: set[str] = set()
    order = list(range(len(docs)))
    tries = 0
    while len(prompts) < n and tries < 50 * n:
        tries += 1
        doc = docs[order[tries % len(order)] if tries <= len(order) else rng.randrange(len(docs))]
        if tries == len(order):
            rng.shuffle(order)
        lines = doc.text.split("\n")
        if len(lines) < 8:
            continue
        start = rng.randrange(0, len(lines) - 4)
        if not lines[start].strip():
            continue
        text = ""
        for end in range(start, min(len(lines), start + 60)):
            cand = "\n".join(lines[start : end + 1]).rstrip()
            n_tok = len(tok.encode(cand).ids)
            if n_tok > r.prompt_max_tokens:
                break
            text = cand
            if n_tok >= r.prompt_min_tokens and lines[end].strip():
                break
        if not text or len(tok.encode(text).ids) < r.prompt_min_tokens or text in seen:
            continue
        seen.add(text)
        prompts.append({"id": f"{tag}-{len(prompts):03d}", "prompt": text, "source": doc.relpath})
    return prompts


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))


# ---------------------------------------------------------------------------------------------- drafter data


@torch.no_grad()
def greedy_continue(target, prefixes: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """[n, P] -> [n, P + new_tokens]: the target's greedy continuation (fp32, KV cache)."""
    out = target(input_ids=prefixes, use_cache=True)
    cache = out.past_key_values
    tok = out.logits[:, -1].argmax(-1)
    pieces = [prefixes, tok[:, None]]
    for _ in range(new_tokens - 1):
        out = target(input_ids=tok[:, None], past_key_values=cache, use_cache=True)
        cache = out.past_key_values
        tok = out.logits[:, -1].argmax(-1)
        pieces.append(tok[:, None])
    return torch.cat(pieces, dim=1)


def target_taps(target, ids: torch.Tensor, layer_ids: list[int]) -> torch.Tensor:
    out = target.model(input_ids=ids, output_hidden_states=True)
    return torch.cat([out.hidden_states[i + 1] for i in layer_ids], dim=-1)


# ---------------------------------------------------------------------------------------------- drafter


def drafter_config(r: Recipe, mask_id: int):
    from dflash_quant.models.config import parse_draft_config

    raw: dict[str, Any] = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "vocab_size": r.vocab_size,
        "hidden_size": r.hidden,
        "intermediate_size": r.draft_intermediate,
        "num_hidden_layers": r.draft_layers,
        "num_attention_heads": r.heads,
        "num_key_value_heads": r.kv_heads,
        "head_dim": r.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": r.max_positions,
        "rms_norm_eps": 1e-6,
        "rope_theta": r.rope_theta,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": False,
        "initializer_range": 0.02,
        "block_size": r.block_size,
        "num_target_layers": r.target_layers,
        "dflash_config": {"mask_token_id": mask_id, "target_layer_ids": list(r.target_layer_ids)},
    }
    if r.conv_kernel_size:
        from scripts.reference_pair.dflash2 import drafter_extra_config

        top, nested = drafter_extra_config(r)
        raw.update(top)
        raw["dflash_config"].update(nested)
    return parse_draft_config(raw, source="reference drafter")


def block_batch(
    seqs: torch.Tensor,
    anchors: torch.Tensor,
    block: int,
    mask_id: int,
    sizes: torch.Tensor | None = None,
    window: int | None = None,
):
    """Block inputs, labels, position ids and the visibility mask for many blocks per sequence.

    seqs [b, L]; anchors [b, A] (anchor positions); sizes [b, A] optional block lengths <= block (the
    decode loop drafts a shorter block when fewer than B tokens remain). Keys are [L context rows, A*B
    block rows]; the queries of block j see context rows at positions < anchor_j and the first sizes_j
    rows of block j (rows past sizes_j are padding: computed, never seen, never scored). window: a sliding-window drafter
    also hides context rows at distance >= window from the query (inside a block rows are always closer).
    """
    b, L = seqs.shape
    A = anchors.shape[1]
    device = seqs.device
    offs = torch.arange(block, device=device)
    pos = anchors[:, :, None] + offs  # [b, A, B]
    tokens = torch.gather(seqs, 1, pos.clamp_max(L - 1).flatten(1)).view(b, A, block)
    inputs = torch.full_like(tokens, mask_id)
    inputs[:, :, 0] = tokens[:, :, 0]
    labels = tokens[:, :, 1:]  # [b, A, B-1]
    ctx_pos = torch.arange(L, device=device)
    position_ids = torch.cat([ctx_pos.expand(b, L), pos.flatten(1)], dim=1)
    ctx_vis = ctx_pos[None, None, None, :] < anchors[:, :, None, None]  # [b, A, 1, L]
    ctx_vis = ctx_vis.expand(b, A, block, L)
    if window is not None:
        ctx_vis = ctx_vis & ((pos[:, :, :, None] - ctx_pos[None, None, None, :]) < window)
    ctx_vis = ctx_vis.reshape(b, A * block, L)
    blk_id = torch.arange(A, device=device).repeat_interleave(block)
    blk_vis = (blk_id[:, None] == blk_id[None, :]).expand(b, A * block, A * block)
    if sizes is not None:
        key_ok = (offs[None, None, :] < sizes[:, :, None]).reshape(b, 1, A * block)
        blk_vis = blk_vis & key_ok
    mask = torch.cat([ctx_vis, blk_vis], dim=2)[:, None]  # [b, 1, A*B, L + A*B]
    return inputs, labels, position_ids, mask


def drafter_loss(drafter, target, seqs, anchors, sizes, r: Recipe, mask_id: int, device: torch.device, weights):
    with torch.no_grad():
        taps = target_taps(target, seqs, r.target_layer_ids)
    inputs, labels, position_ids, mask = block_batch(seqs, anchors, r.block_size, mask_id, sizes, r.draft_window)
    b, A, B = inputs.shape
    embed = target.get_input_embeddings()
    extra = {"conv_block": B} if r.conv_kernel_size else {}  # DFlash2: convolutions never cross blocks
    with autocast(device):
        noise = embed(inputs.view(b, A * B))
        hidden = drafter(noise, taps, position_ids, attention_mask=mask, **extra)
        hidden = hidden.view(b, A, B, -1)[:, :, 1:]
        logits = target.get_output_embeddings()(hidden).float()
    ce = F.cross_entropy(logits.flatten(0, 2), labels.flatten(), reduction="none").view(b, A, B - 1)
    valid = torch.arange(1, B, device=device)[None, None, :] < sizes[:, :, None]
    w = weights * valid
    loss = (ce * w).sum() / w.sum()
    correct = (logits.argmax(-1) == labels) & valid
    if r.conv_kernel_size:
        from scripts.reference_pair.dflash2 import selector_loss

        with autocast(device):
            sel, chosen_ok = selector_loss(drafter.candidate_selector, hidden, logits, inputs[:, :, 0], labels, w)
        loss = loss + r.selector_weight * sel
        correct = chosen_ok & valid  # the decode loop drafts the selector's pick
    return loss, correct


def sample_anchors(n: int, lo: int, hi: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """[n, k] distinct anchor positions in [lo, hi] per row."""
    scores = torch.rand(n, hi - lo + 1, generator=gen)
    return scores.topk(k, dim=1).indices.sort(dim=1).values + lo


def train_drafter(r: Recipe, target, seqs: torch.Tensor, mask_id: int, device: torch.device, log: Log):
    from dflash_quant.models.model2 import build_drafter

    torch.manual_seed(r.seed + 5)
    config = drafter_config(r, mask_id)
    drafter = build_drafter(config).to(device)  # type: ignore[arg-type]  # transformers wraps .to() with @wraps(nn.Module.to): mypy sees it unbound
    drafter.train()
    n_params = sum(p.numel() for p in drafter.parameters())
    log(f"drafter: {n_params / 1e6:.2f} M parameters", drafter_params=n_params)
    opt = make_optimizer(list(drafter.parameters()), r.draft_lr, device)
    gen = torch.Generator().manual_seed(r.seed + 6)
    k = torch.arange(1, r.block_size, device=device, dtype=torch.float32)
    weights = torch.exp(-(k - 1) / r.gamma)
    L = seqs.shape[1]
    lo, hi = r.gen_prefix, L - r.block_size
    t_start = time.perf_counter()
    acc_hist: list[torch.Tensor] = []
    for step in range(r.draft_steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, r.draft_steps, r.draft_warmup, r.draft_lr)
        idx = torch.randint(0, seqs.shape[0], (r.draft_batch,), generator=gen)
        anchors = sample_anchors(r.draft_batch, lo, hi, r.anchors_per_seq, gen)
        sizes = torch.full(anchors.shape, r.block_size, dtype=torch.long)
        short = torch.rand(anchors.shape, generator=gen) < r.short_block_frac
        sizes[short] = torch.randint(2, r.block_size, (int(short.sum()),), generator=gen)
        batch = seqs[idx].to(device, non_blocking=True)
        loss, correct = drafter_loss(
            drafter, target, batch, anchors.to(device), sizes.to(device), r, mask_id, device, weights
        )
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
        opt.step()
        acc_hist.append(correct.detach().int().cumprod(-1).sum(-1).float().mean() + 1)
        stop = step + 1 < r.draft_steps and log.over(0.85)
        if stop:
            log(f"drafter: deadline guard stopped training after step {step + 1}", drafter_truncated=step + 1)
        elif r.draft_stop_step is not None and step + 1 == r.draft_stop_step < r.draft_steps:
            stop = True
            log(f"drafter: stopped at the recipe's draft_stop_step {step + 1} of a {r.draft_steps}-step schedule")
        if (step + 1) % max(1, r.draft_steps // 20) == 0 or step + 1 == r.draft_steps or stop:
            tau_est = torch.stack(acc_hist).mean().item()
            acc_hist.clear()
            log(
                f"drafter step {step + 1}/{r.draft_steps} loss {loss.item():.3f} block-acceptance {tau_est:.2f}",
                step=step + 1,
                loss=loss.item(),
                train_block_tau=tau_est,
                seconds=time.perf_counter() - t_start,
            )
        if stop:
            break
    drafter.eval()
    return drafter


# ---------------------------------------------------------------------------------------------- evaluation


@torch.no_grad()
def replay_tau(drafter, target, full: torch.Tensor, n: int, mask_id: int, device: torch.device):
    """Greedy speculative decoding, replayed exactly: (acceptance lengths, accepted per step).

    Greedy DFlash decoding commits the target's greedy continuation, so the loop's anchors are known once
    that continuation is; the drafter's block at anchor p sees the target taps of positions < p, exactly as
    in the loop. Mirrors dflash_quant.speculative.decode.speculative_generate (and the official dflash_generate): blocks
    shrink to min(B, max_len - start) rows near the end, and the step accounting is clipped there.
    """
    B = drafter.block_size
    max_len = full.shape[1]  # full [1, n + new]: the prompt and the target's greedy continuation
    padded = torch.cat([full, torch.full((1, B), mask_id, device=device)], dim=1)
    taps = target_taps(target, full, drafter.target_layer_ids)
    anchors = torch.arange(n, max_len - 1, device=device)[None]
    sizes = (max_len - anchors).clamp_max(B)  # the loop drafts min(B, max_len - start) rows
    cfg = drafter.config
    window = cfg.sliding_window if cfg.layer_types and "sliding_attention" in cfg.layer_types else None
    inputs, labels, position_ids, mask = block_batch(padded, anchors, B, mask_id, sizes, window)
    embed = target.get_input_embeddings()
    A = anchors.shape[1]
    pad_taps = torch.cat([taps, taps.new_zeros(1, padded.shape[1] - taps.shape[1], taps.shape[2])], dim=1)
    v2 = getattr(cfg, "is_dflash2", False)
    extra = {"conv_block": B} if v2 else {}
    hidden = drafter(embed(inputs.view(1, A * B)), pad_taps, position_ids, attention_mask=mask, **extra)
    hidden = hidden.view(1, A, B, -1)[:, :, 1:]
    logits = drafter.compute_logits(hidden, target.get_output_embeddings())
    if v2:  # DFlash2 drafts through the selector's greedy walk from each anchor
        from scripts.reference_pair.dflash2 import select_blocks

        draft = select_blocks(drafter, hidden[0], logits[0], inputs[0, :, 0])[None]
    else:
        draft = logits.argmax(-1)
    acc_all = (draft == labels).int().cumprod(-1).sum(-1)[0].tolist()  # per anchor
    lengths, accepted = [], []
    start = n
    while start + 1 < max_len:
        size = min(B, max_len - start)
        acc = min(acc_all[start - n], size - 1)
        produced = min(acc + 1, max_len - start - 1)
        lengths.append(produced)
        accepted.append(acc)
        start += produced
    return lengths, accepted


def continuations(target, tok, prompts: list[dict], new_tokens: int, device) -> list[tuple[torch.Tensor, int]]:
    out = []
    for row in prompts:
        ids = tok.encode(row["prompt"]).ids
        out.append((greedy_continue(target, torch.tensor([ids], device=device), new_tokens), len(ids)))
    return out


def evaluate(drafter, target, conts: list[tuple[torch.Tensor, int]], mask_id: int, device, block: int):
    all_lengths, all_acc = [], []
    per_prompt = []
    for full, n in conts:
        lengths, acc = replay_tau(drafter, target, full, n, mask_id, device)
        all_lengths += lengths
        all_acc += acc
        per_prompt.append(sum(lengths) / len(lengths))
    tau_steps = sum(all_lengths) / len(all_lengths)
    tau_prompts = sum(per_prompt) / len(per_prompt)
    per_pos = [sum(a >= k for a in all_acc) / len(all_acc) for k in range(1, block)]
    return {
        "tau": tau_steps,
        "tau_mean_of_prompts": tau_prompts,
        "steps": len(all_lengths),
        "p_accept_at_least_k": per_pos,
    }


# ---------------------------------------------------------------------------------------------- main


def save_target(out: Path, target, tok, r: Recipe) -> None:
    tdir = out / "target"
    target.to(torch.bfloat16).save_pretrained(tdir, safe_serialization=True)
    target.float()
    save_tokenizer(tok, tdir, r.max_positions)


def save_drafter(out: Path, drafter) -> None:
    """Official DFlash layout: config.json (architectures DFlashDraftModel, dflash_config) + model.safetensors."""
    ddir = out / "drafter"
    drafter.to(torch.bfloat16).save_pretrained(ddir, safe_serialization=True)
    drafter.float()
    cfg = json.loads((ddir / "config.json").read_text())
    v2 = getattr(drafter.config, "is_dflash2", False)
    cfg["architectures"] = ["DFlash2DraftModel" if v2 else "DFlashDraftModel"]
    keys: tuple[str, ...] = ("mask_token_id", "target_layer_ids")
    if v2:
        keys += ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
    for key in keys:  # kept inside dflash_config only, as z-lab does
        if key in cfg.get("dflash_config", {}):
            cfg.pop(key, None)
    # z-lab's released configs carry a flat rope_theta, and dflash-mlx builds its drafter from it (field notes 12)
    cfg.setdefault("rope_theta", (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0))
    (ddir / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def run(args: argparse.Namespace) -> dict:
    if args.pair == "dflash2":
        r = dflash2_smoke_recipe() if args.smoke else dflash2_recipe()
    else:
        r = smoke_recipe() if args.smoke else Recipe()
    r.seed = args.seed
    for item in args.set or []:
        key, _, value = item.partition("=")
        if not hasattr(r, key):
            raise SystemExit(f"--set: unknown recipe field {key!r}")
        setattr(r, key, json.loads(value))
    if args.steps_scale != 1.0:
        r.target_steps = max(1, int(r.target_steps * args.steps_scale))
        r.draft_steps = max(1, int(r.draft_steps * args.steps_scale))
        if r.draft_stop_step is not None:
            r.draft_stop_step = max(1, int(r.draft_stop_step * args.steps_scale))
        if r.target_stop_step is not None:
            r.target_stop_step = max(1, int(r.target_stop_step * args.steps_scale))
    device = torch.device(args.device)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log = Log(args.deadline_min * 60 if args.deadline_min else None)
    seed_all(r.seed)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    import tokenizers
    import transformers

    log(
        f"torch {torch.__version__}, transformers {transformers.__version__}, tokenizers {tokenizers.__version__}, "
        f"python {sys.version.split()[0]}, device {device}"
    )

    corpus_dir = Path(args.corpus) if args.corpus else default_corpus_dir()
    docs = load_corpus(corpus_dir)
    if r.max_docs:
        docs = docs[:: max(1, len(docs) // r.max_docs)][: r.max_docs]
    train_docs, held_docs = split_corpus(docs)
    if not held_docs:  # tiny smoke subsets
        held_docs, train_docs = train_docs[:2], train_docs[2:]
    log(
        f"corpus {corpus_dir}: {len(train_docs)} train files ({sum(len(d.text) for d in train_docs)} chars), "
        f"{len(held_docs)} held-out files ({sum(len(d.text) for d in held_docs)} chars)",
        train_files=len(train_docs),
        heldout_files=len(held_docs),
    )

    if args.reuse_target or r.tokenizer_file:  # an earlier run's (drafter iteration) / the first pair's
        from tokenizers import Tokenizer

        if args.reuse_target:
            tok_path = Path(args.reuse_target) / "target" / "tokenizer.json"
        else:
            assert r.tokenizer_file is not None  # the branch condition
            tok_path = PACKAGE_DIR / r.tokenizer_file
        tok = Tokenizer.from_file(str(tok_path))
        log(f"tokenizer: reused {tok_path}")
    else:
        tok = train_tokenizer(train_docs, r.vocab_size)
    eos_id, mask_id = tok.token_to_id(EOS), tok.token_to_id(MASK)
    if eos_id is None or mask_id is None:
        raise SystemExit(f"the tokenizer has no {EOS} or {MASK} token; reuse only a tokenizer this script trained")
    r.vocab_size = tok.get_vocab_size()
    train_stream = encode_stream(tok, train_docs, eos_id)
    held_stream = encode_stream(tok, held_docs, eos_id)
    log(
        f"tokenizer: vocab {r.vocab_size}, eos {eos_id}, mask {mask_id}; {train_stream.numel()} train tokens, "
        f"{held_stream.numel()} held-out tokens",
        train_tokens=train_stream.numel(),
        heldout_tokens=held_stream.numel(),
    )

    rng = random.Random(r.seed + 4)
    calib = make_prompts(tok, train_docs, r.n_calibration, r, rng, "calib")
    held = make_prompts(tok, held_docs, r.n_heldout, r, rng, "heldout")
    write_jsonl(out / "calibration_prompts.jsonl", calib)
    write_jsonl(out / "heldout_prompts.jsonl", held)
    log(f"prompts: {len(calib)} calibration (train split), {len(held)} held-out")

    if args.reuse_target:
        from scripts.reference_pair.dflash2 import target_class

        target = target_class(r).from_pretrained(Path(args.reuse_target) / "target", dtype=torch.float32).to(device)
        target.eval().requires_grad_(False)
        log(f"target: reused from {args.reuse_target}")
    else:
        target = train_target(r, train_stream, held_stream, eos_id, device, log)
    save_target(out, target, tok, r)

    gen = torch.Generator().manual_seed(r.seed + 7)
    prefixes = sample_windows(train_stream, r.gen_sequences, r.gen_prefix, gen)
    batches = []
    for i in range(0, prefixes.shape[0], r.gen_batch):
        batches.append(greedy_continue(target, prefixes[i : i + r.gen_batch].to(device), r.gen_new))
    seqs = torch.cat(batches)
    log(
        f"drafter data: {seqs.shape[0]} greedy continuations of {r.gen_new} tokens after {r.gen_prefix}-token prefixes",
        drafter_sequences=seqs.shape[0],
    )

    drafter = train_drafter(r, target, seqs, mask_id, device, log)
    save_drafter(out, drafter)
    log(f"saved pair under {out}")

    # Evaluate the shipped (bf16-rounded) drafter in fp32, as it will be loaded.
    with torch.no_grad():
        for p in drafter.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    conts = continuations(target, tok, held[: r.eval_prompts], r.eval_new_tokens, device)
    res = evaluate(drafter, target, conts, mask_id, device, r.block_size)
    log(
        f"held-out replay tau {res['tau']:.3f} (mean of prompts {res['tau_mean_of_prompts']:.3f}) over "
        f"{res['steps']} steps; P(accept >= k) {[round(x, 3) for x in res['p_accept_at_least_k']]}",
        **res,
    )

    from scripts.reference_pair.sensitivity import rtn_quantize_drafter

    q = rtn_quantize_drafter(drafter, bits=2, group_size=128, names=drafter.linear_names())
    res2 = evaluate(q, target, conts, mask_id, device, r.block_size)
    log(
        f"2-bit RTN drafter: replay tau {res2['tau']:.3f} ({100 * (1 - res2['tau'] / res['tau']):.1f}% lost)", rtn2=res2
    )

    report = {
        "recipe": asdict(r),
        "events": log.events,
        "eval": res,
        "eval_rtn2": res2,
        "seconds": time.perf_counter() - log.t0,
    }
    (out / "train_log.json").write_text(json.dumps(report, indent=1) + "\n")
    return report


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="output directory (target/, drafter/, prompt files, train_log.json)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--corpus", default=None, help="directory of .py sources (default: this interpreter's stdlib)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--pair",
        choices=["dflash", "dflash2"],
        default="dflash",
        help="dflash: the first pair (Qwen3 + DFlash); dflash2: hybrid Qwen3.5 target + DFlash2 drafter",
    )
    p.add_argument("--smoke", action="store_true", help="tiny configuration that finishes in a minute or two on CPU")
    p.add_argument("--steps-scale", type=float, default=1.0, help="scale both step counts (debugging)")
    p.add_argument(
        "--reuse-target",
        default=None,
        metavar="DIR",
        help="skip tokenizer and target training: take DIR/target from an earlier run (drafter iteration)",
    )
    p.add_argument(
        "--set", nargs="*", metavar="KEY=JSON", help="override recipe fields (debugging), e.g. draft_steps=10"
    )
    p.add_argument(
        "--deadline-min",
        type=float,
        default=None,
        help="safety stop: cut target training at 40%% and drafter training at 85%% of this many minutes",
    )
    p.add_argument("--threads", type=int, default=None, help="CPU threads for torch")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
    run(args)


if __name__ == "__main__":
    main()
