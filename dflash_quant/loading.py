"""Load drafters (bf16 or our quantized artifacts) and targets from a local dir or a Hub repo id.

Safetensors only, no remote code. The pairing is validated before any compute.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from dflash_quant.config import DFlashDraftConfig, parse_draft_config, read_config_json
from dflash_quant.config_check import DraftFields, check_layers_present, check_model_fields, draft_fields
from dflash_quant.errors import DFlashQuantError, UsageError
from dflash_quant.io.weights import (
    DENSE,
    GGUF,
    GPTQ,
    Entry,
    config_format,
    confined,
    existing,
    mlx_packing_problem,
    tensor_entries,
    weight_files,
)
from dflash_quant.model import DFlashDrafter
from dflash_quant.model2 import build_drafter

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
WEIGHT_PATTERNS = ["*.json", "*.safetensors", "*.txt", "*.model", "*.md", "tokenizer*", "*.jinja"]


@dataclass
class Source:
    """Where a model came from, for provenance. kind: `hub`, `shipped` (inside dflash_quant/reference/) or `local`."""

    id: str
    path: Path
    revision: str | None = None
    kind: str = "local"


@dataclass
class LoadedDrafter:
    model: DFlashDrafter
    config: DFlashDraftConfig
    source: Source
    quantization: dict[str, Any] | None = None  # the artifact's quantization_config, if any
    raw_config: dict[str, Any] = field(default_factory=dict)


@dataclass
class LoadedTarget:
    model: torch.nn.Module
    tokenizer: Any | None
    source: Source
    quantization: Any = None  # artifact.reports.TargetQuantization


def resolve(src: str | Path, revision: str | None = None) -> Source:
    """A local directory, the `reference` pair shortcuts, or a Hub repo id (cache; HF_HUB_OFFLINE honoured)."""
    from dflash_quant.reference import is_shipped, pair_dir, parse_shipped, shipped_id

    text = str(src)
    shipped = parse_shipped(text)
    if shipped:
        name, part = shipped
        return Source(id=shipped_id(name, part), path=pair_dir(name) / part, kind="shipped")
    path = Path(text).expanduser()
    if path.is_dir():
        return Source(id=text, path=path, revision=revision, kind="shipped" if is_shipped(path) else "local")
    if path.exists():
        raise DFlashQuantError(f"{path} is a file; pass the model directory that contains config.json")
    if not HUB_ID.match(text):
        raise DFlashQuantError(f"{text} is neither an existing directory nor a Hub repo id (ORG/NAME); check the path")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError

    try:
        local = snapshot_download(text, revision=revision, allow_patterns=WEIGHT_PATTERNS)
    except RepositoryNotFoundError as exc:
        raise DFlashQuantError(f"Hub repo {text} not found or not accessible; check the id or set HF_TOKEN") from exc
    except LocalEntryNotFoundError as exc:
        offline = os.environ.get("HF_HUB_OFFLINE", "") not in ("", "0")
        hint = "it is not in the local cache (HF_HUB_OFFLINE is set)" if offline else "download failed"
        raise DFlashQuantError(f"cannot fetch {text}: {hint}; download it first or pass a local directory") from exc
    except HfHubHTTPError as exc:
        raise DFlashQuantError(
            f"cannot fetch {text} from the Hub ({exc.__class__.__name__}); check the network and token"
        ) from exc
    return Source(id=text, path=Path(local), revision=revision, kind="hub")


def read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """All tensors of a model directory (shards merged), with a clear error on corrupt files."""
    tensors: dict[str, torch.Tensor] = {}
    for file in existing(weight_files(path)):
        try:
            with safe_open(file, framework="pt") as fh:
                for key in fh.keys():
                    tensors[key] = fh.get_tensor(key)
        except (SafetensorError, OSError, ValueError) as exc:
            raise DFlashQuantError(
                f"{file} is not a readable safetensors file ({exc}); re-download or re-export it"
            ) from exc
    return tensors


def _expected_shapes(f: DraftFields) -> dict[str, tuple[int | None, int | None]]:
    """(out, in) of the Linears whose shapes follow from the config alone."""
    q, kv = f.num_attention_heads * f.head_dim, f.num_key_value_heads * f.head_dim
    h, i = f.hidden_size, f.intermediate_size
    return {
        "fc": (h, len(f.target_layer_ids) * h),
        "self_attn.q_proj": (q, h),
        "self_attn.k_proj": (kv, h),
        "self_attn.v_proj": (kv, h),
        "self_attn.o_proj": (h, q),
        "mlp.gate_proj": (i, h),
        "mlp.up_proj": (i, h),
        "mlp.down_proj": (h, i),
    }


def check_draft_weights(fields: DraftFields, entries: dict[str, Entry], source: str, shapes: bool = True) -> None:
    """The drafter config against its weights' headers, before any model is built: layer count and the
    shapes of fc and the first layer's projections (for a GPTQ artifact, the output width of each qweight)."""
    names = [k[len("model.") :] if k.startswith("model.") else k for k in entries]
    check_layers_present(fields.num_hidden_layers, names, source)
    if not shapes:
        return
    stored = dict(zip(names, (list(e.shape) for e in entries.values()), strict=False))
    for part, (n_out, n_in) in _expected_shapes(fields).items():
        base = part if part == "fc" else f"layers.0.{part}"
        weight, qweight = stored.get(f"{base}.weight"), stored.get(f"{base}.qweight")
        if weight is not None and list(weight) != [n_out, n_in]:
            raise DFlashQuantError(
                f"{source}: {base}.weight is {list(weight)} but config.json implies "
                f"[{n_out}, {n_in}]; fix the config or re-download the weights"
            )
        if qweight is not None and (len(qweight) != 2 or qweight[1] != n_out):
            raise DFlashQuantError(
                f"{source}: {base}.qweight is {list(qweight)} but config.json implies "
                f"{n_out} outputs; fix the config or re-export the artifact"
            )


def read_draft_config(source: Source) -> tuple[dict[str, Any], DFlashDraftConfig]:
    """(raw config.json, parsed config) of a drafter dir, checked against its weights' headers first, so a
    config claiming 10^9 layers is refused in milliseconds instead of being built."""
    file = confined(source.path, "config.json")
    raw = read_config_json(file)
    fields = draft_fields(raw, str(file))
    entries = tensor_entries(source.path, required=False)
    if problem := mlx_packing_problem(source.path, entries):
        raise DFlashQuantError(problem)
    # MLX / compressed-tensors pack their weights under other shapes: only the layer count is compared for them
    # (GGUF entries carry the logical shape, GPTQ's qweight its output width)
    fmt = config_format(raw)
    check_draft_weights(fields, entries, str(file), shapes=fmt in (DENSE, GPTQ, GGUF))
    return raw, parse_draft_config(raw, source=str(file))


def check_target_config(source: Source, raw: dict[str, Any]) -> None:
    """A target's config.json before transformers builds it: counts are positive ints, heads split evenly,
    and the layers it claims are in the weights (a missing layer would otherwise be initialised at random)."""
    from dflash_quant.memory.kv import text_config

    file = str(source.path / "config.json")
    cfg = text_config(raw)
    check_model_fields(cfg, file)
    if cfg.get("num_hidden_layers") is not None:
        check_layers_present(cfg["num_hidden_layers"], list(tensor_entries(source.path)), file, exact=False)


def layer_setting(qcfg: dict[str, Any], name: str) -> tuple[int, int]:
    """(bits, group_size) of one Linear: the config's, or its `dynamic` override (first match wins, as in vLLM)."""
    from dflash_quant.export.gptq_dynamic import resolve
    from dflash_quant.quantize.mixed import Candidate

    base = Candidate(int(qcfg["bits"]), int(qcfg["group_size"]))
    got = resolve(qcfg.get("dynamic") or {}, name, base)
    if got is None:
        raise DFlashQuantError(f"{name} has packed GPTQ tensors but a `dynamic` rule skips it; re-export")
    return got.bits, got.group_size


def _dequantize_gptq(tensors: dict[str, torch.Tensor], qcfg: dict[str, Any]) -> dict[str, torch.Tensor]:
    from dflash_quant.export.gptq_v1 import unpack_gptq_v1

    out: dict[str, torch.Tensor] = {}
    bases = {k[: -len(".qweight")] for k in tensors if k.endswith(".qweight")}
    for key, value in tensors.items():
        base = key.rsplit(".", 1)[0]
        if base in bases:
            continue
        out[key] = value
    for base in sorted(bases):
        parts = {
            s: tensors[f"{base}.{s}"] for s in ("qweight", "qzeros", "scales", "g_idx") if f"{base}.{s}" in tensors
        }
        if len(parts) < 4:
            raise DFlashQuantError(
                f"quantized layer {base} lacks {sorted({'qweight', 'qzeros', 'scales', 'g_idx'} - set(parts))}; re-export"
            )
        bits, group = layer_setting(qcfg, base)
        out[f"{base}.weight"] = unpack_gptq_v1(parts, bits=bits, group_size=group)
        if f"{base}.bias" in tensors:
            out[f"{base}.bias"] = tensors[f"{base}.bias"]
    return out


def _read_weights(source: Source, raw: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Dense weights of a drafter dir, each quantized format dequantized through its own reader."""
    qcfg = raw.get("quantization_config") or {}
    method = qcfg.get("quant_method")
    if method == GGUF:
        from dflash_quant.export.gguf import read_gguf

        return read_gguf(source.path)
    tensors = read_safetensors(source.path)
    if method == "gptq":
        return _dequantize_gptq(tensors, qcfg)
    if method == "compressed-tensors":
        from dflash_quant.export.compressed_tensors import read_compressed_tensors

        return read_compressed_tensors(tensors, qcfg)
    if method is not None:
        raise DFlashQuantError(
            f"{source.id} uses quant_method={method!r}; dflash-quant loads gptq, compressed-tensors, gguf and mlx artifacts"
        )
    if isinstance(raw.get("quantization"), dict):  # MLX affine (mlx-lm's config key)
        from dflash_quant.export.mlx import read_mlx

        return read_mlx(tensors, raw["quantization"])
    return tensors


def load_drafter(
    src: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32, revision: str | None = None
) -> LoadedDrafter:
    """Build a DFlashDrafter from a bf16 drafter dir / Hub id, or from a quantized artifact (dequantized)."""
    source = resolve(src, revision)
    raw, config = read_draft_config(source)
    qcfg = raw.get("quantization_config") or raw.get("quantization")
    tensors = _read_weights(source, raw)
    tensors = {k[len("model.") :] if k.startswith("model.") else k: v for k, v in tensors.items()}
    for key, value in tensors.items():
        if value.is_floating_point() and not torch.isfinite(value).all():
            raise DFlashQuantError(f"{source.id}: tensor {key} contains NaN or inf; the checkpoint is damaged")

    with torch.device("meta"):
        model = build_drafter(config)
    expected = set(model.state_dict().keys())
    missing = sorted(expected - tensors.keys())
    unexpected = sorted(tensors.keys() - expected)
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing {missing[:4]}{' ...' if len(missing) > 4 else ''}")
        if unexpected:
            parts.append(f"unexpected {unexpected[:4]}{' ...' if len(unexpected) > 4 else ''}")
        raise DFlashQuantError(f"{source.id}: weights do not match the DFlash layout ({'; '.join(parts)})")
    model = model.to_empty(device=device)
    try:
        model.load_state_dict({k: v.to(dtype) for k, v in tensors.items()}, strict=True)
    except RuntimeError as exc:
        first = str(exc).strip().splitlines()[-1].strip()
        raise DFlashQuantError(
            f"{source.id}: weight shapes do not match config.json ({first}); fix the config or weights"
        ) from exc
    with torch.device(device):  # meta init left inv_freq empty
        model.rotary_emb = type(model.rotary_emb)(config)
    model.to(device=device, dtype=dtype).eval()  # type: ignore[call-arg]  # transformers wraps .to() with @wraps(nn.Module.to): mypy sees it unbound
    return LoadedDrafter(model=model, config=config, source=source, quantization=qcfg, raw_config=raw)


def load_target(
    src: str | Path,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    revision: str | None = None,
    placement: Any = None,
) -> LoadedTarget:
    """The target on `device`, or split by `placement` (a devmap.Placement, checked before weights load)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # our own progress goes to stderr; keep the output clean
    hf_logging.set_verbosity_error()
    source = resolve(src, revision)
    raw = read_config_json(confined(source.path, "config.json"))
    if "mask_token_id" in raw or "dflash_config" in raw:
        raise DFlashQuantError(f"{source.id} is a DFlash drafter, not a target; pass the target model with --target")
    weight_files(source.path)  # refuse pickle-only targets before transformers looks
    check_target_config(source, raw)
    from dflash_quant.target_quant import load_quantized_target

    method = str((raw.get("quantization_config") or {}).get("quant_method") or "").lower()
    quantization = None
    if method and placement is not None:
        raise UsageError(
            f"target {source.id} is quantized ({method}) and is loaded packed on one device; drop --device-map/--max-memory"
        )
    if method:
        model, quantization = load_quantized_target(source.path, raw, source.id, dtype, device)
        model.to(device)
        model.eval()
    else:
        place: dict[str, Any] = {}
        if placement is not None:
            from dflash_quant.devmap import check_placement, load_kwargs

            check_placement(source.path, placement, dtype, source.id)
            place = load_kwargs(placement)
        try:
            model = AutoModelForCausalLM.from_pretrained(
                source.path, dtype=dtype, trust_remote_code=False, use_safetensors=True, **place
            )
        except (OSError, ValueError, KeyError) as exc:
            raise DFlashQuantError(
                f"cannot load target {source.id} with transformers ({exc}); it must be a causal LM"
            ) from exc
        if placement is None:
            model.to(device)  # type: ignore[arg-type]  # transformers wraps .to() with @wraps(nn.Module.to): mypy sees it unbound
        model.eval()
    tokenizer = None
    if any((source.path / f).exists() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        tokenizer = AutoTokenizer.from_pretrained(source.path, trust_remote_code=False)
    from dflash_quant.target_quant import describe

    return LoadedTarget(model=model, tokenizer=tokenizer, source=source, quantization=describe(model, quantization))


def check_pair(config: DFlashDraftConfig, target: torch.nn.Module) -> None:
    """Raise DFlashQuantError (one line) if the drafter cannot run on this target."""
    tcfg: Any = target.config.get_text_config() if hasattr(target.config, "get_text_config") else target.config  # type: ignore[operator]
    t_hidden, t_layers = int(tcfg.hidden_size), int(tcfg.num_hidden_layers)
    t_vocab = int(target.get_input_embeddings().weight.shape[0])  # type: ignore[operator]  # nn.Module.__getattr__ types transformers' methods as Tensor | Module
    fc_in, want = config.num_taps * config.hidden_size, config.num_taps * t_hidden
    if config.hidden_size != t_hidden:
        raise DFlashQuantError(
            f"drafter fc takes {fc_in} features but {config.num_taps} taps x target hidden {t_hidden} = {want} "
            f"(drafter hidden {config.hidden_size}); pair the drafter with the target it was trained for"
        )
    bad = [i for i in config.target_layer_ids if not 0 <= i < t_layers]
    if bad:
        raise DFlashQuantError(
            f"drafter taps target layers {bad} but the target has {t_layers} layers; pair it with its own target"
        )
    if not 0 <= config.mask_token_id < t_vocab:
        raise DFlashQuantError(
            f"mask_token_id {config.mask_token_id} is outside the target vocabulary ({t_vocab}); wrong target"
        )
    if config.block_size < 2:
        raise DFlashQuantError(f"block_size {config.block_size} < 2; a drafter must propose at least one token")
    if config.is_dflash2:
        check_selector_head(config, target)


def check_selector_head(config: DFlashDraftConfig, target: torch.nn.Module) -> None:
    """DFlash2's selector takes the top-k of a dense target head and indexes its codebooks by token id."""
    head = target.get_output_embeddings()  # type: ignore[operator]  # nn.Module.__getattr__ types transformers' methods as Tensor | Module
    weight = getattr(head, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or not callable(head):
        raise DFlashQuantError(
            "the DFlash2 candidate selector needs a dense target lm_head (get_output_embeddings() with a 2-D weight); "
            "this target has none"
        )
    head_vocab = int(weight.shape[0])
    if int(config.vocab_size) != head_vocab:
        raise DFlashQuantError(
            f"DFlash2 selector codebooks cover {config.vocab_size} tokens but the target head has {head_vocab}; "
            "pair the drafter with the target it was trained for"
        )
    if config.selector_top_k > head_vocab:
        raise DFlashQuantError(
            f"selector_top_k {config.selector_top_k} exceeds the target vocabulary ({head_vocab}); fix the config"
        )
