"""What a `gptq` run quantizes and how: the method, the grid, the engine profile's bf16 Linears, the skip list
(torch-free, so a job is checked before anything heavy loads)."""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from dflash_quant.errors import UsageError
from dflash_quant.quantize.spec import QuantSpec

# Linears each engine needs in bf16 (field-notes sections 5 and 10): vLLM's fused context-KV precompute reads
# qkv_proj.weight; SGLang builds qkv_proj unquantized and mis-loads a packed `fc` (SGLang issue #39087: a
# W4A16 DFlash2 drafter accepted ~1.05 instead of 5.25), so its profile keeps fc bf16 too.
QKV_PATTERN = r"(^|\.)self_attn\.(q|k|v)_proj$"


PROFILES: dict[str, list[str]] = {
    "full": [],
    "vllm": [QKV_PATTERN],
    "sglang": [QKV_PATTERN, r"^fc$"],
}


METHODS = ("gptq", "rtn")


@dataclass
class QuantSettings:
    method: str = "gptq"
    bits: int = 4
    group_size: int = 128
    sym: bool = True
    desc_act: bool = False  # act-order measured as a wash on the reference pair (README, reference_recipes.json)
    static_groups: bool = False
    clip_search: bool = False  # per-group range shrink before GPTQ (grid.clip_params); the mixed search uses it
    damp: float = 0.01
    lazy_block: int = 128
    sequential: bool = False
    profile: str = "full"
    skip: tuple[str, ...] = ()
    min_rows: int = 64
    # DFlash2 extras, off by default because every engine keeps them bf16 (field-notes section 3):
    quantize_conv: bool = False  # the convolutions' kernel_projection Linears (base_kernel always stays bf16)
    quantize_selector: bool = False  # the selector's hidden_projection Linear (the codebooks always stay bf16)

    def normalized(self) -> QuantSettings:
        """RTN has no column order: act-order flags would only mislabel the checkpoint."""
        if self.method == "rtn":
            return replace(self, desc_act=False, static_groups=False, clip_search=False)
        return self

    def spec(self) -> QuantSpec:
        return QuantSpec(bits=self.bits, group_size=self.group_size, sym=self.sym)

    def check(self) -> None:
        if self.method not in METHODS:
            raise UsageError(f"--method must be gptq or rtn, got {self.method!r}")
        if self.profile not in PROFILES:
            raise UsageError(f"--profile must be one of {', '.join(PROFILES)}, got {self.profile!r}")
        if not 0 < self.damp < 1:
            raise UsageError(f"--damp must be in (0, 1) (fraction of the mean Hessian diagonal), got {self.damp}")
        self.spec()  # validates bits / group size
        for pattern in self.skip:
            try:
                re.compile(pattern)
            except re.error as exc:
                raise UsageError(f"--skip {pattern!r} is not a valid regular expression ({exc})") from exc
