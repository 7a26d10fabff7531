"""Peak memory of calibration (`gptq` capture), predicted from the configs, and `budget --calibration`.

Calibration holds, at once: the target's weights, the drafter's weights, one fp32 Hessian per drafter input
group (fc's is num_taps x hidden wide: 5 x 5120 -> 2.6 GB for the 27B drafters), and the activations of the
largest target forward. The two candidate largest forwards are:
  prefill   the longest prompt P: target KV for P tokens, the (L + 1) hidden states output_hidden_states
            returns ([P, hidden] each), one row of logits;
  last step the final verify: target KV for P + N + B tokens, (L + 1) hidden states of a B-token block,
            B rows of logits (B = block size, N = max new tokens).
Terms that do not stay resident (the drafter's context KV and its block logits, and the transients inside one
target layer: MLP [P, 3 x intermediate], and on CPU, where SDPA runs the math path, the [heads, P, P] scores)
are added to the peak but left out of `resident`, which is what the CPU tracking in capture can see.
The replay of --sequential lives in host memory and is not counted.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dflash_quant.artifact.reports import CalibrationBudget, CalibrationFix, GpuRef
from dflash_quant.errors import UsageError
from dflash_quant.memory.budget import DEFAULT_CUBLAS_WORKSPACE, resolve_drafter, resolve_target
from dflash_quant.memory.gpus import resolve_gpu
from dflash_quant.memory.kv import ModelShape, dtype_bytes, kv_per_token, recurrent_state_bytes
from dflash_quant.memory.weights import count_params

FP32 = 4


def hessian_widths(drafter: ModelShape, kv_hessian: str = "block+context") -> dict[str, int]:
    """Input width of every Hessian capture collects for a DFlash drafter (calibration.capture.input_group)."""
    h = drafter.hidden_size
    q = drafter.num_attention_heads * drafter.head_dim
    widths = {"fc": drafter.num_taps * h}
    for i in range(drafter.num_layers):
        widths[f"layers.{i}.self_attn.qkv"] = h
        if kv_hessian == "block+context":
            widths[f"layers.{i}.self_attn.kv"] = h
        widths[f"layers.{i}.self_attn.o_proj"] = q
        widths[f"layers.{i}.mlp.gate_up"] = h
        widths[f"layers.{i}.mlp.down_proj"] = drafter.intermediate_size
    return widths


@dataclass
class CalibrationPrediction:
    """Predicted bytes by term; `peak` is the whole, `resident` leaves out the transients."""

    terms: dict[str, int]
    transient: dict[str, int] = field(default_factory=dict)
    phase: str = "prefill"  # which forward is the larger

    @property
    def resident(self) -> int:
        return sum(self.terms.values())

    @property
    def peak(self) -> int:
        return self.resident + sum(self.transient.values())

    def on(self, devices: dict[str, str], device: str) -> int:
        """Bytes of the peak that sit on `device`, given {term: device} (terms not listed follow 'compute')."""
        every = {**self.terms, **self.transient}
        return sum(v for k, v in every.items() if devices.get(k, devices.get("compute")) == device)

    def to_dict(self) -> dict[str, Any]:
        return {**self.terms, **{f"transient_{k}": v for k, v in self.transient.items()}}


def predict_calibration(
    target: ModelShape,
    target_weight_bytes: int,
    drafter: ModelShape,
    drafter_weight_bytes: int,
    prompt_tokens: int,
    max_new_tokens: int,
    *,
    dtype: str = "bfloat16",
    kv_hessian: str = "block+context",
    attention_scores: bool = False,
    offloaded_weight_bytes: int = 0,
    cublas_workspace_bytes: int = 0,
    rows: int = 1,
    teacher_taps: int = 0,
) -> CalibrationPrediction:
    """Peak calibration memory for the longest prompt (prompt_tokens) generating max_new_tokens.

    dtype: the run's compute dtype (activations and KV); weights are given in bytes as they are resident.
    attention_scores: count SDPA's [heads, P, P] scores (CPU math path; CUDA's fused kernels keep none).
    offloaded_weight_bytes: the largest module streamed in from cpu/disk offload (it is resident while it runs).
    cublas_workspace_bytes: on CUDA, the cuBLAS workspace torch takes from its caching allocator (0 on CPU).
    rows: prompts decoded as rows of one batch (batch_decode: every row padded to the longest prompt, caches
    compacted to at most prompt + new tokens + one block): every per-request term times rows.
    teacher_taps: --teacher-forced with this many tapped layers: the target decodes `rows` prompts greedily
    (one token per forward after the prefill) keeping only the taps of every position; the drafter then runs
    one prompt at a time.
    """
    a = dtype_bytes(dtype)
    p, n = prompt_tokens, max_new_tokens
    b = drafter.block_size or 16
    h, layers = target.hidden_size, target.num_layers
    kv = kv_per_token(target, dtype)
    state = recurrent_state_bytes(target, 0, conv_dtype=dtype)  # hybrid targets: fixed-size per request
    prefill = {
        "target_kv": rows * (kv.bytes_for(p) + state),
        "hidden_states": rows * (layers + 1) * p * h * a,
        "logits": rows * target.vocab_size * a,
    }
    last = {
        "target_kv": rows * (kv.bytes_for(p + n + b) + state),
        "hidden_states": rows * (layers + 1) * b * h * a,
        "logits": rows * b * target.vocab_size * a,
    }
    if teacher_taps:  # two live layer outputs in the prefill, the taps of every position of every row kept
        prefill["target_kv"] = rows * (kv.bytes_for(p + n + 1) + state)
        prefill["hidden_states"] = rows * (teacher_taps * (p + n) + 2 * p) * h * a
        last = {}
    phase, acts = ("prefill", prefill) if sum(prefill.values()) >= sum(last.values()) else ("last_step", last)
    terms = {
        "target_weights": target_weight_bytes,
        "drafter_weights": drafter_weight_bytes,
        "hessians": sum(w * w * FP32 for w in hessian_widths(drafter, kv_hessian).values()),
        **acts,
    }
    if cublas_workspace_bytes:
        terms["cublas_workspace"] = cublas_workspace_bytes
    dkv = 2 * drafter.num_kv_heads * drafter.head_dim * a * drafter.num_layers * (p + n)
    drafting = 1 if teacher_taps else rows  # a teacher's drafter runs prompt by prompt
    transient = {
        "drafter_kv": drafting * dkv,
        "drafter_logits": drafting * b * drafter.vocab_size * a,
        "layer_mlp": rows * 3 * p * target.intermediate_size * a,
    }
    if attention_scores:
        transient["attention_scores"] = rows * 2 * target.num_attention_heads * p * p * a
    if offloaded_weight_bytes:
        transient["offloaded_module"] = offloaded_weight_bytes
    return CalibrationPrediction(terms, transient, phase)


RESERVE = 1 << 30  # kept free on the GPU: the CUDA context (~0.5 GiB) and allocator slack


def _gib(n: int, up: bool = False) -> str:
    """Bytes as a --max-memory size, rounded to 0.01 GiB (down for a GPU limit, up for host memory)."""
    step = (1 << 30) / 100
    units = -(-n // step) if up else n // step
    return f"{units / 100:.2f}GiB"


def mean_layer_bytes(shape: ModelShape, weight_bytes: int) -> int:
    """One decoder layer's share of the target's weights (embedding and head left out): what accelerate
    streams onto the GPU at a time for an offloaded layer."""

    pc = count_params(shape)
    outside = pc.other.get("embed_tokens", 0) + pc.other.get("lm_head", 0)
    per_param = weight_bytes / max(pc.total_params, 1)
    return int((pc.total_params - outside) * per_param / shape.num_layers)


def largest_module_bytes(shape: ModelShape, weight_bytes: int) -> int:
    """The largest module accelerate places whole: a decoder layer, the embedding or the head. Its
    `device_map="auto"` keeps that much of the GPU's --max-memory free for streaming offloaded modules, and
    with a 248k vocabulary the head (2.5 GB at 27B) is larger than a layer."""
    pc = count_params(shape)
    per_param = weight_bytes / max(pc.total_params, 1)
    ends = max(pc.other.get("embed_tokens", 0), pc.other.get("lm_head", 0))
    return max(mean_layer_bytes(shape, weight_bytes), int(ends * per_param))


def calibration_budget(
    target: str,
    drafter: str,
    gpu: str,
    prompt_tokens: int,
    max_new_tokens: int,
    kv_hessian: str = "block+context",
    target_weights: str | None = None,
    rows: int = 1,
    teacher: bool = False,
) -> Any:
    """Will `gptq` calibration (bf16 target and drafter, fp32 Hessians) fit on `gpu`? If not, which flags fix it:
    first --hessian-device cpu; then also --device-map auto with a --max-memory that leaves the GPU room for
    the activations and one streamed layer. rows: prompts per batch (--calib-batch); teacher: --teacher-forced."""

    if prompt_tokens < 1 or max_new_tokens < 1:
        raise UsageError("--prompt-tokens and --max-new-tokens must be at least 1")
    if rows < 1:
        raise UsageError(f"--calib-batch must be at least 1, got {rows}")
    t = resolve_target(target, target_weights, engine="reference")
    d = resolve_drafter(drafter)
    card = resolve_gpu(gpu)
    pred = predict_calibration(
        t.shape,
        t.weight_bytes,
        d.shape,
        d.bf16_bytes,
        prompt_tokens,
        max_new_tokens,
        kv_hessian=kv_hessian,
        cublas_workspace_bytes=DEFAULT_CUBLAS_WORKSPACE,
        rows=rows,
        teacher_taps=(d.shape.num_taps or 1) if teacher else 0,
    )
    usable = card.total_bytes - RESERVE
    rep = CalibrationBudget(
        gpu=GpuRef(name=card.name, total_bytes=card.total_bytes),
        usable_bytes=usable,
        reserve_bytes=RESERVE,
        target=t.label,
        drafter=d.label,
        prompt_tokens=prompt_tokens,
        max_new_tokens=max_new_tokens,
        kv_hessian=kv_hessian,
        predicted=pred.to_dict(),
        phase=pred.phase,
        peak_bytes=pred.peak,
        fits=pred.peak <= usable,
    )
    if rep.fits:
        return rep
    hess = pred.terms["hessians"]
    if pred.peak - hess <= usable:
        rep.fix = CalibrationFix(
            fits=True,
            flags=["--hessian-device cpu"],
            gpu_bytes=pred.peak - hess,
            cpu_bytes=hess,
            target_on_gpu_bytes=t.weight_bytes,
            streamed_bytes=0,
        )
        return rep
    layer = mean_layer_bytes(t.shape, t.weight_bytes)
    stream = largest_module_bytes(t.shape, t.weight_bytes)
    others = pred.peak - hess - t.weight_bytes  # activations, drafter, transients: never offloaded
    limit = usable - others  # --max-memory for GPU 0; accelerate keeps its largest module free for streaming
    on_gpu = max(0, limit - stream)
    # Host room for the rest plus one layer: accelerate fills the GPU whole layers at a time, and whatever
    # the cpu limit cannot take goes to disk, read back from files on every forward.
    off = t.weight_bytes - on_gpu + layer
    flags = [
        "--hessian-device cpu",
        "--device-map auto",
        f"--max-memory 0={_gib(max(limit, 0))},cpu={_gib(off, up=True)}",
    ]
    rep.fix = CalibrationFix(
        fits=on_gpu > 0,
        flags=flags,
        gpu_bytes=on_gpu + stream + others,
        cpu_bytes=off + hess,
        target_on_gpu_bytes=on_gpu,
        streamed_bytes=t.weight_bytes - on_gpu,
    )
    return rep
