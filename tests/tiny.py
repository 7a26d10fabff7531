"""Tiny real transformers targets, tokenizers and DFlash drafters, built on the fly (no downloads)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

from dflash_quant.models.config import parse_draft_config
from dflash_quant.models.model import DFlashDrafter
from dflash_quant.models.model2 import DFlash2Drafter

WORDS = [f"w{i}" for i in range(120)]
VOCAB = ["<unk>", "<eos>", "<|MASK|>"] + WORDS  # 123 tokens


def build_tokenizer(chat: bool = False) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(VOCAB)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>")
    if chat:
        fast.chat_template = (
            "{% for m in messages %}{{ m['content'] }} {% endfor %}{% if add_generation_prompt %}w0{% endif %}"
        )
    return fast


def target_config(**over) -> Qwen3Config:
    kw = dict(
        vocab_size=len(VOCAB),
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,
        tie_word_embeddings=False,
        eos_token_id=1,
        max_position_embeddings=512,
    )
    kw.update(over)
    return Qwen3Config(**kw)


def save_target(path: Path, seed: int = 0, **over) -> Path:
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(target_config(**over)).eval()
    model.save_pretrained(path)
    build_tokenizer().save_pretrained(path)
    return path


def drafter_raw_config(**over) -> dict:
    raw = dict(
        architectures=["DFlashDraftModel"],
        model_type="qwen3",
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,
        vocab_size=len(VOCAB),
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        block_size=4,
        num_target_layers=4,
        dflash_config={"mask_token_id": 2, "target_layer_ids": [0, 2]},
    )
    raw.update(over)
    return raw


def save_drafter(path: Path, seed: int = 1, prefix: str = "", std: float = 0.02, **over) -> Path:
    """Save a drafter in the official layout (optionally with a `model.` key prefix)."""
    torch.manual_seed(seed)
    cfg = parse_draft_config(drafter_raw_config(**over))
    cfg.initializer_range = std
    model = DFlashDrafter(cfg).eval()
    path.mkdir(parents=True, exist_ok=True)
    from safetensors.torch import save_file

    save_file({prefix + k: v.contiguous() for k, v in model.state_dict().items()}, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(drafter_raw_config(**over), indent=2))
    return path


HYBRID_LAYERS = ["linear_attention", "linear_attention", "linear_attention", "full_attention"]


def hybrid_target_config(family: str = "qwen3_5", **over):
    """A tiny hybrid (Gated-DeltaNet + full attention) text config: `qwen3_5` or `qwen3_next` (a small MoE).

    initializer_range 0.1 (not 0.02) makes the output depend clearly on the recurrent state, so a wrong state
    after a rejected draft changes the greedy tokens (with 0.02 half the prompts hid the bug).
    """
    kw = dict(
        vocab_size=len(VOCAB),
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,
        tie_word_embeddings=False,
        eos_token_id=1,
        max_position_embeddings=512,
        layer_types=list(HYBRID_LAYERS),
        linear_conv_kernel_dim=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        initializer_range=0.1,
    )
    if family == "qwen3_next":
        from transformers import Qwen3NextConfig

        kw.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)
        kw.update(over)
        return Qwen3NextConfig(**kw)
    from transformers import Qwen3_5TextConfig

    kw.update(over)
    return Qwen3_5TextConfig(**kw)


def save_hybrid_target(path: Path, family: str = "qwen3_5", seed: int = 0, **over) -> Path:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hybrid_target_config(family, **over)).eval()
    model.save_pretrained(path)
    build_tokenizer().save_pretrained(path)
    return path


def dflash2_raw_config(**over) -> dict:
    """A tiny DFlash2 drafter config in the release layout: DFlash2 keys in `dflash_config`, all layers
    sliding-window with `is_causal: false` (as Qwen3.8-27B-DFlash2)."""
    raw = drafter_raw_config(
        architectures=["DFlash2DraftModel"],
        layer_types=["sliding_attention", "sliding_attention"],
        sliding_window=16,
        use_sliding_window=True,
        is_causal=False,
        dflash_config={
            "mask_token_id": 2,
            "target_layer_ids": [0, 2],
            "conv_kernel_size": 2,
            "conv_group_size": 16,
            "selector_rank": 8,
            "selector_top_k": 4,
        },
    )
    raw.update(over)
    return raw


def dflash2_state_dict(cfg, seed: int = 1, std: float = 0.02) -> dict[str, torch.Tensor]:
    """Random DFlash2 weights with a non-trivial convolution (our init makes it the identity)."""
    torch.manual_seed(seed)
    cfg.initializer_range = std
    model = DFlash2Drafter(cfg).eval()
    with torch.no_grad():
        for layer in model.layers:
            for conv in (layer.attention_conv, layer.mlp_conv):
                conv.base_kernel.add_(torch.randn_like(conv.base_kernel) * 0.2)
                conv.kernel_projection.weight.normal_(std=0.1)
    return {k: v.contiguous() for k, v in model.state_dict().items()}


def save_dflash2_drafter(path: Path, seed: int = 1, prefix: str = "", std: float = 0.02, **over) -> Path:
    """Save a DFlash2 drafter in the official layout (codebook keys without `.weight`)."""
    raw = dflash2_raw_config(**over)
    state = dflash2_state_dict(parse_draft_config(raw), seed=seed, std=std)
    path.mkdir(parents=True, exist_ok=True)
    from safetensors.torch import save_file

    save_file({prefix + k: v for k, v in state.items()}, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(raw, indent=2))
    return path


def save_pair_with_prompts(root: Path, seed: int = 0) -> dict[str, Path]:
    """A tiny drafter (std 0.2, so its drafts get accepted sometimes) + target, with 8 calibration and 3 eval
    prompt lines of the target's words: what the `gptq` CLI tests run end to end."""
    import random

    rng = random.Random(seed)

    def line() -> str:
        return " ".join(f"w{rng.randint(3, 119)}" for _ in range(8))

    (root / "calib.txt").write_text("\n".join(line() for _ in range(8)))
    (root / "eval.txt").write_text("\n".join(line() for _ in range(3)))
    return {"root": root, "drafter": save_drafter(root / "drafter", std=0.2), "target": save_target(root / "target")}
