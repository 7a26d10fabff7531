"""`dflash-quant inspect`: parsed config, parameter counts and bytes by module of a drafter or artifact."""

from __future__ import annotations

from collections import defaultdict

import typer
from rich.table import Table

from dflash_quant.cli.common import handle_errors, out_console, print_json
from dflash_quant.io.source import resolve


def describe(src: str) -> dict:
    from math import prod

    from dflash_quant.io.weights import dtype_name, tensor_entries
    from dflash_quant.loading.drafter import read_draft_config
    from dflash_quant.memory.weights import module_of

    source = resolve(src)
    raw, cfg = read_draft_config(source)
    params: dict[str, int] = defaultdict(int)
    nbytes: dict[str, int] = defaultdict(int)
    dtypes: dict[str, int] = defaultdict(int)
    # headers only, in the artifact's own format (a GGUF tensor counts its logical elements)
    for key, e in tensor_entries(source.path).items():
        key = key[len("model.") :] if key.startswith("model.") else key
        mod = module_of(key)
        params[mod] += prod(e.shape)
        nbytes[mod] += e.nbytes
        dtypes[dtype_name(e.dtype)] += e.nbytes
    config = {"variant": "DFlash2" if cfg.is_dflash2 else "DFlash"}
    if cfg.is_dflash2:
        config.update(
            {k: getattr(cfg, k) for k in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")}
        )
    return {
        "source": source.id,
        "config": {
            **config,
            "hidden_size": cfg.hidden_size,
            "num_hidden_layers": cfg.num_hidden_layers,
            "num_attention_heads": cfg.num_attention_heads,
            "num_key_value_heads": cfg.num_key_value_heads,
            "head_dim": cfg.head_dim,
            "intermediate_size": cfg.intermediate_size,
            "block_size": cfg.block_size,
            "mask_token_id": cfg.mask_token_id,
            "target_layer_ids": cfg.target_layer_ids,
            "layer_types": list(cfg.layer_types or []),
            "sliding_window": cfg.sliding_window,
            "attention": [
                dict(zip(("is_causal", "sliding_window"), cfg.attention_kind(i), strict=True))
                for i in range(cfg.num_hidden_layers)
            ],
            "rope_parameters": cfg.rope_parameters,
        },
        "quantization_config": raw.get("quantization_config"),
        "stored_elements": sum(params.values()),
        "bytes": sum(nbytes.values()),
        "by_module": {m: {"elements": params[m], "bytes": nbytes[m]} for m in sorted(params)},
        "by_dtype": dict(dtypes),
        "dflash2_parts": _dflash2_parts(params, nbytes) if cfg.is_dflash2 else None,
    }


def _dflash2_parts(params: dict[str, int], nbytes: dict[str, int]) -> dict:
    """Totals of the DFlash2-only parts (kept bf16 by default) over all layers."""
    kinds = {
        "conv": lambda m: m.endswith(("attention_conv", "mlp_conv")),
        "selector_codebooks": lambda m: m.endswith("_codebook"),
        "selector_projection": lambda m: m.endswith("hidden_projection"),
    }
    return {
        kind: {
            "elements": sum(params[m] for m in params if test(m)),
            "bytes": sum(nbytes[m] for m in nbytes if test(m)),
        }
        for kind, test in kinds.items()
    }


@handle_errors
def inspect(
    drafter: str = typer.Argument(
        ..., help="Drafter dir, Hub id, quantized artifact, or a shipped pair: 'reference', 'reference-dflash2'."
    ),
    json_out: bool = typer.Option(False, "--json", help="Print JSON on stdout."),
) -> None:
    """Print a drafter's parsed config and its parameters and bytes by module."""
    info = describe(drafter)
    if json_out:
        print_json(info)
        return
    cfg = Table(title=f"{info['source']}: config")
    cfg.add_column("key")
    cfg.add_column("value", overflow="fold")
    for k, v in info["config"].items():
        cfg.add_row(k, str(v))
    if info["quantization_config"]:
        cfg.add_row("quantization", str(info["quantization_config"]))
    out_console.print(cfg)
    mods = Table(title="stored tensors by module")
    for col in ("module", "elements", "bytes"):
        mods.add_column(col, justify="left" if col == "module" else "right")
    for m, v in info["by_module"].items():
        mods.add_row(m, f"{v['elements']:,}", f"{v['bytes']:,}")
    mods.add_row("total", f"{info['stored_elements']:,}", f"{info['bytes']:,}")
    out_console.print(mods)
    if info["dflash2_parts"]:
        parts = Table(title="DFlash2 parts (all layers)")
        for col in ("part", "elements", "bytes"):
            parts.add_column(col, justify="left" if col == "part" else "right")
        for name, v in info["dflash2_parts"].items():
            parts.add_row(name, f"{v['elements']:,}", f"{v['bytes']:,}")
        out_console.print(parts)


def register(app: typer.Typer) -> None:
    app.command("inspect")(inspect)
