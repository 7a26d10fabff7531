"""GPTQ `dynamic` per-module overrides for a mixed-precision drafter, as GPTQModel writes them and vLLM reads them.

Format (quantize_config.json / quantization_config): "dynamic" maps a pattern to a dict of overrides
(e.g. {"bits": 8, "group_size": 32}). A pattern prefixed "-:" excludes matching modules from quantization;
"+:" or no prefix overrides them. vLLM walks the patterns in order and the first `re.match` against the
module's full name wins, so patterns here are anchored at both ends and list each Linear that differs from
the base setting.
vLLM quantizes fused projections (q/k/v -> qkv_proj, gate/up -> gate_up_proj) with one setting looked up
under the fused name, so a mix that splits a fused group is not loadable there; `vllm_fused_conflicts` names them.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from dflash_quant.errors import DFlashQuantError, UsageError
from dflash_quant.quantize.mixed import Candidate

# vLLM's fused names for the Qwen3-style blocks DFlash drafters use
VLLM_FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def base_setting(picks: Mapping[str, Candidate]) -> Candidate:
    """The most common pick (ties: the larger one, so overrides list the fewer big modules' neighbours)."""
    if not picks:
        raise UsageError("a mixed-precision export needs at least one quantized Linear")
    counts: dict[Candidate, int] = {}
    for c in picks.values():
        counts[c] = counts.get(c, 0) + 1
    return max(counts, key=lambda c: (counts[c], c.bits, c.group_size))


def dynamic_overrides(picks: Mapping[str, Candidate], base: Candidate) -> dict[str, dict[str, int]]:
    """One anchored "+:" rule per Linear whose setting differs from the base."""
    out: dict[str, dict[str, int]] = {}
    for name, c in picks.items():
        if c == base:
            continue
        rule: dict[str, int] = {}
        if c.bits != base.bits:
            rule["bits"] = c.bits
        if c.group_size != base.group_size:
            rule["group_size"] = c.group_size
        out[f"+:^{re.escape(name)}$"] = rule
    return out


def resolve(dynamic: Mapping[str, Mapping[str, int]], name: str, base: Candidate) -> Candidate | None:
    """The setting an engine reads for `name`: first matching rule wins; None if a "-:" rule skips it."""
    for pattern, rule in dynamic.items():
        if pattern.startswith("-:"):
            if re.match(pattern[2:], name):
                return None
        elif re.match(pattern.removeprefix("+:"), name):
            return Candidate(int(rule.get("bits", base.bits)), int(rule.get("group_size", base.group_size)))
    return base


def vllm_fused_conflicts(picks: Mapping[str, Candidate]) -> list[str]:
    """Fused vLLM modules whose parts got different settings (vLLM would load them with one setting)."""
    bad: list[str] = []
    for name in picks:
        parent, _, leaf = name.rpartition(".")
        for fused, parts in VLLM_FUSED.items():
            if leaf != parts[0]:
                continue
            got = {picks.get(f"{parent}.{p}") for p in parts}
            if len(got) > 1:
                bad.append(f"{parent}.{fused}")
    return bad


def tie_fused(picks: Mapping[str, Candidate]) -> dict[str, Candidate]:
    """Raise each fused group to its largest pick, so vLLM can load the mix (costs bytes, never acceptance)."""
    out = dict(picks)
    for name in picks:
        parent, _, leaf = name.rpartition(".")
        for parts in VLLM_FUSED.values():
            if leaf != parts[0]:
                continue
            members = [f"{parent}.{p}" for p in parts if f"{parent}.{p}" in picks]
            top = max((picks[m] for m in members), key=lambda c: (c.bits, -c.group_size))
            for m in members:
                out[m] = top
    return out


def layer_setting(qcfg: dict[str, Any], name: str) -> tuple[int, int]:
    """(bits, group_size) of one Linear: the config's, or its `dynamic` override (first match wins, as in vLLM)."""
    base = Candidate(int(qcfg["bits"]), int(qcfg["group_size"]))
    got = resolve(qcfg.get("dynamic") or {}, name, base)
    if got is None:
        raise DFlashQuantError(f"{name} has packed GPTQ tensors but a `dynamic` rule skips it; re-export")
    return got.bits, got.group_size
