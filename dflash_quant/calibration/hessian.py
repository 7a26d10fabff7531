"""The statistics calibration collects for GPTQ: a streaming X^T X of each Linear's inputs (fp32)."""

from __future__ import annotations

import torch

from dflash_quant.errors import DFlashQuantError, UsageError


class HessianAccumulator:
    """Streaming sum of X^T X (fp32, [in, in]) over calibration rows of one layer's input."""

    def __init__(self, in_features: int, *, name: str = "", device: torch.device | str | None = None):
        if in_features <= 0:
            raise UsageError(f"layer {name!r}: in_features must be positive, got {in_features}")
        self.in_features = in_features
        self.name = name
        self.rows = 0
        self._xtx = None if device is None else torch.zeros(in_features, in_features, device=device)

    @property
    def xtx(self) -> torch.Tensor | None:
        return self._xtx

    @property
    def device(self) -> torch.device | None:
        return None if self._xtx is None else self._xtx.device

    def add(self, x: torch.Tensor) -> None:
        """Add inputs of shape [..., in] (any float dtype); the first call fixes the device."""
        if x.shape[-1] != self.in_features:
            raise DFlashQuantError(
                f"layer {self.name!r}: calibration input width {x.shape[-1]} != in_features {self.in_features}"
            )
        x = x.detach().reshape(-1, self.in_features)
        if x.shape[0] == 0:
            return
        if not torch.isfinite(x).all():
            bad = int((~torch.isfinite(x)).any(dim=1).sum())
            raise DFlashQuantError(
                f"layer {self.name!r}: {bad} calibration rows contain NaN/inf; "
                "check the drafter's forward in this dtype or drop the offending prompts"
            )
        if self._xtx is None:
            self._xtx = torch.zeros(self.in_features, self.in_features, device=x.device)
        # Chunks of at most in_features rows: the fp32 copy never outgrows the Hessian itself.
        for start in range(0, x.shape[0], self.in_features):
            chunk = x[start : start + self.in_features].to(device=self._xtx.device, dtype=torch.float32)
            self._xtx.addmm_(chunk.T, chunk)
        self.rows += x.shape[0]

    def merge(self, other: HessianAccumulator) -> HessianAccumulator:
        """Add another accumulator's rows into this one (e.g. q/k/v sharing one input)."""
        if other.in_features != self.in_features:
            raise DFlashQuantError(
                f"cannot merge Hessians of width {other.in_features} ({other.name!r}) into {self.in_features} ({self.name!r})"
            )
        if other._xtx is not None:
            if self._xtx is None:
                self._xtx = other._xtx.detach().clone().float()
            else:
                self._xtx += other._xtx.to(self._xtx.device, torch.float32)
        self.rows += other.rows
        return self

    def hessian(self) -> torch.Tensor:
        """H = 2 X^T X / rows (fp32, a new tensor)."""
        if self.rows == 0 or self._xtx is None:
            raise DFlashQuantError(
                f"layer {self.name!r}: no calibration rows were collected; check that calibration reaches this layer"
            )
        return self._xtx * (2.0 / self.rows)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Flat tensors (safetensors-friendly): xtx fp32 [in, in] and rows int64 [1]."""
        xtx = self._xtx if self._xtx is not None else torch.zeros(self.in_features, self.in_features)
        return {"xtx": xtx.contiguous(), "rows": torch.tensor([self.rows], dtype=torch.int64)}

    @classmethod
    def from_state_dict(
        cls, state: dict[str, torch.Tensor], *, name: str = "", device: torch.device | str | None = None
    ) -> HessianAccumulator:
        if "xtx" not in state or "rows" not in state:
            raise DFlashQuantError(f"layer {name!r}: Hessian cache lacks 'xtx'/'rows'; delete the cache and recollect")
        xtx = state["xtx"]
        if xtx.dim() != 2 or xtx.shape[0] != xtx.shape[1]:
            raise DFlashQuantError(f"layer {name!r}: cached Hessian has shape {tuple(xtx.shape)}, expected square")
        acc = cls(xtx.shape[0], name=name)
        acc._xtx = xtx.to(device=device if device is not None else xtx.device, dtype=torch.float32).clone()
        acc.rows = int(state["rows"].reshape(-1)[0])
        return acc
