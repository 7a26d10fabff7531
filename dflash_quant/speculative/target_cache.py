"""The target's cache in the speculative loop, rolled back exactly after rejected drafts (hybrid targets too).

Attention K/V (full or sliding window, with past recording on) is rolled back by cropping. The conv and
recurrent states of linear-attention layers (Gated DeltaNet in `qwen3_5`, `qwen3_next`, and every model using
transformers' LinearAttention cache layers) cannot be cropped: after a verify forward they have absorbed the
rejected drafts. So before each verify we clone those states (small: per layer a conv window and one
recurrent matrix per head), and after a partial acceptance we restore them and replay the committed tokens of
the block in one target forward. A fully accepted block needs no replay. A cache layer of any other kind is
refused with one line: a state we cannot roll back would silently change the output.
"""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache
from transformers import cache_utils as cu

from dflash_quant.errors import DFlashQuantError
from dflash_quant.models.devmap import input_device

# Looked up by name: the classes moved between transformers releases (5.17 on the GPU image, 5.24 here).
_LINEAR = getattr(cu, "LinearAttentionCacheLayerMixin", None)
_DUMMY = getattr(cu, "DummyLayer", None)
_ATTENTION = cu.DynamicLayer  # DynamicSlidingWindowLayer and DynamicIndexedLayer derive from it


def cache_kw(model: torch.nn.Module) -> str:
    # transformers renamed `past_key_values` to `cache` (5.2x); accept both.
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def make_cache(config, rollback: bool = True) -> DynamicCache:
    """A DynamicCache for `config`; with rollback, layers keep what is needed to be cropped (past recording)."""
    cache = DynamicCache(config=config)
    if rollback and hasattr(cache, "activate_past_recording"):
        # Sliding windows and conv states keep the rows a crop may need. transformers >= 5.25 can also record
        # per-token recurrent states (computed token by token); we ask for none and restore + replay instead,
        # so the verify forward runs the same chunked kernel on every version.
        kwargs = {"recurrent_states_to_keep": 0} if _records_recurrent() else {}
        cache.activate_past_recording(**kwargs)
    return cache


def _records_recurrent() -> bool:
    method = getattr(_LINEAR, "activate_past_recording", None)
    return method is not None and "recurrent_states_to_keep" in inspect.signature(method).parameters


def _sync(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def _is_linear(layer) -> bool:
    return _LINEAR is not None and isinstance(layer, _LINEAR)


def _has_attention(layer) -> bool:
    return isinstance(layer, _ATTENTION)


def _attention_crop(layer, tokens: int) -> None:
    """Crop only the attention part of a layer that holds linear-attention state too (one cache layer for both)."""
    for cls in type(layer).__mro__:
        if issubclass(cls, _ATTENTION) and not (_LINEAR is not None and issubclass(cls, _LINEAR)):
            cls.crop(layer, -tokens)
            return


def _classify(cache: DynamicCache, model_type: str) -> list[int]:
    """Indices of layers with linear-attention state; raise for a layer that cannot be rolled back."""
    stateful = []
    for i, layer in enumerate(cache.layers):
        if _DUMMY is not None and isinstance(layer, _DUMMY):
            continue
        if _is_linear(layer):
            stateful.append(i)
            continue
        # Quantized KV layers derive from DynamicLayer but say they cannot be cropped.
        if _has_attention(layer) and getattr(type(layer), "is_croppable", True) is not False:
            continue
        raise DFlashQuantError(
            f"target cache layer {i} is a {type(layer).__name__} (model_type {model_type}), which the speculative "
            "check cannot roll back after a rejected draft; only attention K/V and linear-attention conv/recurrent "
            "states are supported, so use a target whose transformers cache is built from those"
        )
    return stateful


@dataclass
class Saved:
    """What the cache held before a verify forward: its length and clones of the linear-attention states."""

    length: int
    size: int  # tokens the verify forward adds
    states: dict[int, dict] = field(default_factory=dict)


class TargetCache:
    """The target's cache plus the bookkeeping to bring it to exactly the committed tokens after each step."""

    def __init__(self, target: torch.nn.Module, cache: DynamicCache | None = None):
        self.target = target
        self.kw = cache_kw(target)
        self.cache = make_cache(target.config) if cache is None else cache
        self.model_type = str(getattr(target.config, "model_type", type(target).__name__))
        self.stateful = _classify(self.cache, self.model_type)
        self._classified = len(self.cache.layers)
        self.replay_forwards = 0
        self.replayed_tokens = 0
        self.replay_seconds = 0.0

    def _refresh(self) -> None:
        # A DynamicCache built without layer types creates its layers during the first forward.
        if len(self.cache.layers) != self._classified:
            self.stateful = _classify(self.cache, self.model_type)
            self._classified = len(self.cache.layers)

    def _crop(self, tokens: int) -> None:
        """Remove `tokens` from every attention layer; crop(0) also trims recorded pasts back to their working size.

        Linear-attention layers are only ever trimmed (crop(0)): what a crop of them does differs between
        transformers releases (5.25 rolls the recurrent state back from a history we do not record), so after a
        rejected draft their state is restored from `save` by the caller, never cropped.
        """
        layer: Any  # cache layer classes differ across transformers versions: duck-typed via _is_linear/_has_attention
        for layer in self.cache.layers:
            if _DUMMY is not None and isinstance(layer, _DUMMY):
                continue
            linear, attention = _is_linear(layer), _has_attention(layer)
            if linear and tokens == 0 and all(layer.is_conv_states_initialized.values()):
                layer.crop(0)  # (a conv-free layer never initializes its conv state: nothing to trim)
            if not attention or not layer.is_initialized or (linear and tokens == 0):
                continue
            _attention_crop(layer, tokens) if linear else layer.crop(-tokens)

    def save(self, length: int, size: int) -> Saved:
        """Call right before the verify forward of `size` tokens, with `length` tokens committed so far."""
        self._refresh()
        self._crop(0)
        saved = Saved(length=length, size=size)
        for i in self.stateful:
            layer: Any = self.cache.layers[i]
            saved.states[i] = {
                "conv": {k: None if v is None else v.clone() for k, v in layer.conv_states.items()},
                "recurrent": {k: None if v is None else v.clone() for k, v in layer.recurrent_states.items()},
                "has_previous_state": dict(layer.has_previous_state),
                # transformers >= 5.25 counts the tokens a linear layer has seen
                "length": getattr(layer, "cumulative_length_linear", None),
            }
            if saved.states[i]["length"] is not None:
                saved.states[i]["length"] = saved.states[i]["length"].clone()
        return saved

    def _restore(self, saved: Saved) -> None:
        for i, state in saved.states.items():
            layer: Any = self.cache.layers[i]
            for k, v in state["conv"].items():
                layer.conv_states[k] = v
            for k, v in state["recurrent"].items():
                if (
                    v is not None
                    and layer.recurrent_states[k] is not None
                    and layer.recurrent_states[k].shape == v.shape
                ):
                    layer.recurrent_states[k].copy_(v)  # keep the tensor the layer handed out (static address)
                else:
                    layer.recurrent_states[k] = v
            layer.has_previous_state.update(state["has_previous_state"])
            if state["length"] is not None:
                layer.cumulative_length_linear.copy_(state["length"])
            history = getattr(layer, "recurrent_states_history", None)
            if history is not None:  # the verify forward's recorded entry belongs to the rejected block
                for k in history:
                    history[k] = []

    def _batch(self, op) -> None:
        """Apply `op` to every batched tensor of the cache: attention K/V, conv and recurrent states."""
        layer: Any
        for layer in self.cache.layers:
            if _DUMMY is not None and isinstance(layer, _DUMMY):
                continue
            if _has_attention(layer) and layer.is_initialized:
                layer.keys, layer.values = op(layer.keys), op(layer.values)
            if _is_linear(layer):
                for states in (layer.conv_states, layer.recurrent_states):
                    for k, v in states.items():
                        if isinstance(v, torch.Tensor):
                            states[k] = op(v)
                        elif isinstance(v, list):
                            states[k] = [op(x) for x in v]

    def fork(self, rows: int) -> None:
        """Copy the cache into `rows` batch rows, for a verify forward of several candidate continuations.

        Call after `save` (which trims recorded pasts), before the batched forward; `pick` keeps one row."""
        self._refresh()
        self._batch(lambda t: t.repeat_interleave(rows, dim=0))

    def pick(self, row: int) -> None:
        """Keep batch row `row` (the candidate the step commits); `commit` then rolls it back as for one row."""
        self._batch(lambda t: t[row : row + 1].clone())

    def commit(self, saved: Saved, ids: torch.Tensor, length: int, final: bool = False) -> None:
        """Bring the cache to exactly the first `length` tokens of `ids` after the verify forward of `saved`.

        final: the loop stops here and the cache is never read again, so no replay is spent on it.
        """
        rejected = saved.length + saved.size - length
        if rejected <= 0:
            return
        if not self.stateful or final:
            self._crop(rejected)
            return

        device = input_device(self.target, ids.device)  # a split target takes its ids on its embedding's device
        t0 = _sync(device)
        self._crop(saved.size)  # attention back to the pre-block length; conv/recurrent restored below
        self._restore(saved)
        self.target(
            ids[saved.length : length][None].to(device),
            position_ids=torch.arange(saved.length, length, device=device)[None],
            **{self.kw: self.cache},
            use_cache=True,
            logits_to_keep=1,
        )
        self.replay_forwards += 1
        self.replayed_tokens += length - saved.length
        self.replay_seconds += _sync(device) - t0
