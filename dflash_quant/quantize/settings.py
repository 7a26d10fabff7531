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


# gptq-kl: GPTQ codes, then each group's scale tuned end to end on the drafter's KL to its bf16 self (quantize.tune)
METHODS = ("gptq", "gptq-kl", "rtn")
# Chosen on the development split (benchmarks/studies/kl_tuning.py); the held-out prompts only measure them.
TUNE_EPOCHS = 2
TUNE_LR = 2e-3
# on llama.cpp's k-quant grids (one multiplier per 256-weight super-block): 1e-3 beat 2e-3 on the file-disjoint dev
# split at Q3_K_S and the Q2_K mix (benchmarks/results/kl_tuning_devfiles_kquant.json)
TUNE_LR_KQUANT = 1e-3
# how far (in code steps) each code offset may travel over the whole tuning: every signed step is this / the number
# of steps (AutoRound's lr = 1 / iterations), at most TUNE_CODE_STEP_MAX, so more calibration prompts do not move
# codes further and a short tuning does not flip them in a few steps; 2.0 x 1/192 is about the 0.01 per step the
# default was chosen with (96 dev prompts x 2 epochs)
TUNE_CODE_TRAVEL = 2.0
TUNE_CODE_STEP_MAX = 0.01  # a flip needs >= 50 agreeing steps
TUNE_ROWS = ("all", "reached")  # gptq-kl: the block rows the loss scores
# Chosen on the file-disjoint development split (benchmarks/results/kl_tuning_devfiles_target.json): scoring only
# the rows acceptance reads, and the target's own token there, beat KL on every row at 3-bit g128 and Q3_K_S.
TUNE_ROWS_DEFAULT = "reached"
TUNE_TARGET = 3.0
# from 128 to 640 calibration prompts gptq-kl gained on prompts near the drafter's training files and never lost
# beyond noise on held-out ones (3-bit, both shipped pairs; docs/quality.md), so a run tuned on fewer says so
TUNE_MIN_PROMPTS = 512


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
    tune_epochs: int = TUNE_EPOCHS  # gptq-kl: passes over the recorded calibration inputs
    # gptq-kl: Adam step on each group's log scale multiplier; None: the grid's default (tune_lr_for)
    tune_lr: float | None = None
    tune_codes: bool = True  # gptq-kl: codes may also move one step (signed-gradient offsets, as AutoRound)
    tune_code_travel: float = TUNE_CODE_TRAVEL
    tune_anchor: float = 0.0  # gptq-kl: weight of the Linears' Hessian-weighted error to their bf16 weights in the loss
    tune_position_decay: float = 0.0  # gptq-kl: block row k's KL weighs exp(-(k-1)/decay); 0: uniform
    tune_norms: bool = False  # gptq-kl: the RMSNorm weights are tuned too (not quantized; every format keeps them)
    tune_rows: str = TUNE_ROWS_DEFAULT  # gptq-kl: "reached": only the rows the bf16 drafter's own drafts reach
    tune_target: float = TUNE_TARGET  # gptq-kl: weight of the cross-entropy to the target's token on those rows

    def tune_lr_for(self, kquant: bool) -> float:
        """The step size tuning uses: the one given, else TUNE_LR, or TUNE_LR_KQUANT on a llama.cpp k-quant grid."""
        if self.tune_lr is not None:
            return self.tune_lr
        return TUNE_LR_KQUANT if kquant else TUNE_LR

    @property
    def calibrated(self) -> bool:
        """GPTQ needs the calibration Hessians (rtn does not)."""
        return self.method != "rtn"

    @property
    def tuned(self) -> bool:
        return self.method == "gptq-kl"

    @property
    def needs_replay(self) -> bool:
        """Sequential GPTQ and scale tuning re-run the drafter on its recorded calibration inputs."""
        return self.sequential or self.tuned

    def normalized(self) -> QuantSettings:
        """RTN has no column order: act-order flags would only mislabel the checkpoint."""
        if self.method == "rtn":
            return replace(self, desc_act=False, static_groups=False, clip_search=False)
        return self

    def spec(self) -> QuantSpec:
        return QuantSpec(bits=self.bits, group_size=self.group_size, sym=self.sym)

    def check(self) -> None:
        if self.method not in METHODS:
            raise UsageError(f"--method must be one of {', '.join(METHODS)}, got {self.method!r}")
        if self.tune_epochs < 1:
            raise UsageError(f"--tune-epochs must be >= 1, got {self.tune_epochs}")
        if self.tune_lr is not None and not 0 < self.tune_lr < 1:
            raise UsageError(f"--tune-lr must be in (0, 1), got {self.tune_lr}")
        if not 0 < self.tune_code_travel <= 100:
            raise UsageError(
                f"--tune-code-travel must be in (0, 100] (code steps over the tuning), got {self.tune_code_travel}"
            )
        if not 0 <= self.tune_anchor <= 1000:
            raise UsageError(f"--tune-anchor must be in [0, 1000] (0: KL alone), got {self.tune_anchor}")
        if not 0 <= self.tune_position_decay <= 1000:
            raise UsageError(
                f"--tune-position-decay must be in [0, 1000] (0: every block position weighs 1), "
                f"got {self.tune_position_decay}"
            )
        if self.tune_rows not in TUNE_ROWS:
            raise UsageError(f"--tune-rows must be one of {', '.join(TUNE_ROWS)}, got {self.tune_rows!r}")
        if not 0 <= self.tune_target <= 100:
            raise UsageError(f"--tune-target must be in [0, 100] (0: KL alone), got {self.tune_target}")
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
