"""A model's step on one device, as the step model needs it: gradient sizes and ready times.

A ``Profile`` is measured (``measure.profile_model``: hooks on a real backward) or derived from
the architecture (``flops.analytic_profile``: each layer's backward time in proportion to its
FLOPs, scaled to a published step time). It is saved and loaded as JSON, so a profile taken on one
machine can be fed to ``python -m gpucomm.scaling --profile``.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["Profile", "PROFILE_VERSION"]

PROFILE_VERSION = 1


@dataclass
class Profile:
    """One training step of ``model`` on one device with ``batch_size`` samples.

    ``names[i]``, ``sizes[i]`` (gradient bytes) and ``ready_s[i]`` (seconds from the start of
    backward until that gradient was final) describe parameter i in the model's parameter order;
    ``forward_s``, ``backward_s`` (start of backward to its end) and ``update_s`` (the optimizer
    step) are the parts of the step. ``source`` says how it was obtained."""

    model: str
    batch_size: int
    names: list[str]
    sizes: list[int]
    ready_s: list[float]
    forward_s: float
    backward_s: float
    update_s: float = 0.0
    device: str = "unknown"
    source: str = "unknown"
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        n = len(self.names)
        if len(self.sizes) != n or len(self.ready_s) != n:
            raise ValueError(f"Profile {self.model!r}: {n} names, {len(self.sizes)} sizes and {len(self.ready_s)} "
                             "ready times; there must be one of each per parameter.")
        for name in ("forward_s", "backward_s", "update_s"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v >= 0):
                raise ValueError(f"Profile {self.model!r}: {name}={v!r} must be finite seconds >= 0.")
        if self.batch_size < 1:
            raise ValueError(f"Profile {self.model!r}: batch_size={self.batch_size} must be >= 1.")

    @property
    def step_s(self) -> float:
        """One device's step without communication: forward + backward + update."""
        return self.forward_s + self.backward_s + self.update_s

    @property
    def total_bytes(self) -> int:
        return sum(self.sizes)

    def scaled(self, step_s: float, *, source: str | None = None) -> "Profile":
        """The same shape of step, every time multiplied so that the step takes ``step_s`` (e.g. a
        published single-GPU time)."""
        if not (step_s > 0 and self.step_s > 0):
            raise ValueError(f"Profile {self.model!r}: cannot scale a {self.step_s} s step to {step_s} s; both must "
                             "be > 0 seconds.")
        k = step_s / self.step_s
        return Profile(self.model, self.batch_size, list(self.names), list(self.sizes), [t * k for t in self.ready_s],
                       self.forward_s * k, self.backward_s * k, self.update_s * k, self.device,
                       source or f"{self.source}, scaled to {step_s:.4g} s per step", dict(self.extra))

    def to_dict(self) -> dict[str, Any]:
        return {"version": PROFILE_VERSION, **asdict(self)}

    def save(self, path: str) -> None:
        """Write the profile as JSON."""
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=1)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Profile":
        version = d.get("version")
        if version != PROFILE_VERSION:
            raise ValueError(f"profile: version {version!r} is not {PROFILE_VERSION}; make it again with this gpucomm "
                             "(python -m gpucomm.scaling --model ... --save-profile PATH).")
        fields = {k: v for k, v in d.items() if k != "version"}
        try:
            return cls(**fields)
        except TypeError as e:
            raise ValueError(f"profile: not a gpucomm profile ({e}); make one with --save-profile.") from None

    @classmethod
    def load(cls, path: str) -> "Profile":
        """Read a profile written by ``save``."""
        try:
            with open(path) as f:
                d = json.load(f)
        except (OSError, ValueError) as e:
            raise ValueError(f"profile {path}: cannot read it as JSON ({e}).") from None
        return cls.from_dict(d)
