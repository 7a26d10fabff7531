"""Budget objects from user-facing strings, and the budget report dict (CLI `budget`, memory.json, gptq)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from dflash_quant.artifact.reports import Budget
from dflash_quant.artifact.sources import model_label
from dflash_quant.errors import UsageError
from dflash_quant.memory.budget import (
    DEFAULT_RUNTIME_OVERHEAD,
    ENGINES,
    BudgetSettings,
    compare_drafters,
    kv_summary,
    load_config,
    resolve_drafter,
    resolve_target,
)
from dflash_quant.memory.gpus import parse_bytes, resolve_gpu
from dflash_quant.memory.kv import dtype_bytes
from dflash_quant.memory.mtp import DEFAULT_MTP_TOKENS, compare_mtp, mtp_head

if TYPE_CHECKING:
    from dflash_quant.artifact.reports import Budget


def budget_objects(
    target: str,
    drafter: str,
    gpu: str,
    context: int,
    concurrency: int,
    spec_tokens: int | None,
    target_weights: str | None,
    kv_dtype: str | None,
    drafter_kv_dtype: str | None,
    state_dtype: str | None,
    engine: str,
    utilization: float | None,
    runtime_overhead: str | None,
    cuda_graphs: str | None,
    prefill_chunk: int,
    max_num_seqs: int,
    activation: str | None,
    new_tokens: int,
    group_size: int,
    *,
    prefix_caching: bool = True,
):

    if engine not in ENGINES:
        raise UsageError(f"unknown --engine {engine!r}; use one of {', '.join(ENGINES)}")
    if context < 0:
        raise UsageError(f"--context must not be negative (got {context})")
    card = resolve_gpu(gpu)
    for name, value in (
        ("--kv-dtype", kv_dtype),
        ("--drafter-kv-dtype", drafter_kv_dtype),
        ("--state-dtype", state_dtype),
    ):
        if value is not None and value != "auto":
            dtype_bytes(value, what=name)
    t = resolve_target(target, target_weights, engine=engine)
    d = resolve_drafter(drafter, group_size=group_size)
    k = spec_tokens if spec_tokens is not None else ((d.shape.block_size or 16) - 1)
    settings = BudgetSettings(
        gpu_name=card.name,
        gpu_bytes=card.total_bytes,
        context=context,
        concurrency=concurrency,
        spec_tokens=k,
        engine=engine,
        kv_dtype=None if kv_dtype in (None, "auto") else kv_dtype,
        drafter_kv_dtype=None if drafter_kv_dtype in (None, "auto") else drafter_kv_dtype,
        state_dtype=None if state_dtype in (None, "auto") else state_dtype,
        gpu_memory_utilization=utilization,
        runtime_overhead_bytes=DEFAULT_RUNTIME_OVERHEAD
        if runtime_overhead is None
        else parse_bytes(runtime_overhead, what="--runtime-overhead"),
        cuda_graph_bytes=None if cuda_graphs is None else parse_bytes(cuda_graphs, what="--cuda-graphs"),
        prefill_chunk=prefill_chunk,
        max_num_seqs=max_num_seqs,
        activation_bytes=None if activation is None else parse_bytes(activation, what="--activation"),
        new_tokens=new_tokens,
        prefix_caching=prefix_caching,
    )
    return t, d, settings


def budget_report(t, d, settings, *, target_label: str | None = None, drafter_label: str | None = None):
    """What `budget --json` prints and memory.json embeds as budget_24gb (artifact.reports.Budget).

    The labels replace the model arguments as given (an artifact records them in their portable form)."""

    budgets = compare_drafters(t, d, settings)
    report = Budget.from_dict(
        {
            "gpu": {"name": settings.gpu_name, "total_bytes": settings.gpu_bytes},
            "engine": settings.engine,
            "settings": {
                "context": settings.context,
                "concurrency": settings.concurrency,
                "spec_tokens": settings.spec_tokens,
                "gpu_memory_utilization": settings.utilization,
                "runtime_overhead_bytes": settings.runtime_overhead_bytes,
                "cuda_graph_bytes": settings.cuda_graphs,
                "prefill_chunk": settings.prefill_chunk,
                "max_num_seqs": settings.max_num_seqs,
                "activation_override_bytes": settings.activation_bytes,
                "new_tokens": settings.new_tokens,
                "prefix_caching": settings.prefix_caching,
            },
            "target": {
                "source": target_label or t.label,
                "weight_bytes": t.weight_bytes,
                "weight_format": t.weight_format,
                "weights_from": t.weight_source,
            },  # fmt: skip
            "drafter": {
                "source": drafter_label or d.label,
                "bf16_bytes": d.bf16_bytes,
                "quantized_bytes": d.quantized_bytes,
                "quantized_format": d.quantized_format,
                "weights_from": d.source,
                "bf16_by_part": d.bf16_parts,
                "quantized_by_part": d.quantized_parts,
            },  # fmt: skip
            "caches": kv_summary(t, d, settings),
            "budgets": {k: b.as_dict() for k, b in budgets.items()},
        }
    )
    return report


def embedded_budget(
    target: str,
    drafter: str,
    gpu: str = "rtx4090",
    context: int = 8192,
    target_weights: str | None = "int4",
    *,
    target_label: str | None = None,
    drafter_label: str | None = None,
):
    """The 24 GB budget stored in memory.json: one request, vLLM defaults, bf16 vs this drafter."""

    t, d, settings = budget_objects(
        target, drafter, gpu, context, 1, None, target_weights, None, None, None, "vllm", None, None, None, 2048, 256, None, 0, 128,
    )  # fmt: skip
    budget = budget_report(
        t,
        d,
        settings,
        target_label=target_label or model_label(target),
        drafter_label=drafter_label or model_label(drafter),
    )
    return with_mtp_comparison(budget, target, t, d, settings)


def parse_mtp_tokens(text: str | None) -> tuple[int, ...]:
    """'1,2,3' -> (1, 2, 3); None -> the default K = 1..3."""

    if text is None:
        return DEFAULT_MTP_TOKENS
    try:
        ks = tuple(int(x) for x in str(text).split(",") if x.strip())
    except ValueError:
        raise UsageError(f"cannot read --mtp-tokens {text!r}; write K values such as 1 or 1,2,3") from None
    if not ks or any(k < 1 for k in ks):
        raise UsageError(f"--mtp-tokens needs K values >= 1 (got {text!r})")
    return tuple(dict.fromkeys(ks))


def mtp_comparison(target: str, t, d, settings, mtp_tokens=None, mtp_weights: str | None = None) -> dict:
    """`budget --compare-mtp`: no speculation, MTP (each K), DFlash bf16 / quantized, side by side."""

    _, root, _ = load_config(target)
    return compare_mtp(t, d, settings, root=root, mtp_tokens=mtp_tokens or DEFAULT_MTP_TOKENS, mtp_weights=mtp_weights)


def with_mtp_comparison(rep: Budget, target: str, t, d, settings) -> Budget:
    """Add the MTP comparison to a budget report when the target ships an MTP head (memory.json, the card)."""

    if settings.engine == "vllm" and mtp_head(t.shape) is not None:
        rep.compare_mtp = mtp_comparison(target, t, d, settings)
    return rep
