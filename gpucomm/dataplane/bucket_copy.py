"""``BucketCopy``: one bucket's pack into its fusion buffer and unpack out of it, step after step.

On CUDA each direction is one Numba kernel launch (``gpucomm.kernels.BoundCopy``: the layout is
checked and tabled once, a call checks only addresses). Whether the kernels can run is decided
once per process (``gpucomm.kernels.availability``): if not, one warning, one count in
``kernel_fallbacks``, and from then on torch ops with as few launches as torch allows
(``TorchCopy``): ``torch._foreach_copy_`` between the tensors and views of the buffer in the
tensors' shapes, built once per buffer, so a copy is one multi-tensor launch (torch cuts long
lists into a few) and a scale is one more. CPU buffers use the one-pass torch path (``torch_pack``,
``torch_unpack``). ``pack_bucket``/``unpack_bucket`` copy a bucket once.
Both paths follow ``gpucomm.kernels.rules``: products in float32 (float64 for float64), then one
rounding to the destination dtype.
"""

from __future__ import annotations

import contextlib
import operator
from typing import Any, Callable, Sequence, TypeVar

import torch

from ..kernels import availability, rules
from ..settings import FUSION_KERNELS
from .finite import FirstNonFinite

_SHAPE = operator.attrgetter("shape")
T = TypeVar("T")

__all__ = ["BucketCopy", "KERNELS_ENV", "TorchCopy", "kernels_wanted", "pack_bucket", "stream_context",
           "torch_pack", "torch_unpack", "unpack_bucket", "without_grad"]

KERNELS_ENV = FUSION_KERNELS.names[0]  # "0": pack CUDA buckets with torch ops instead of the kernels


def kernels_wanted(flat: torch.Tensor) -> bool:
    """Whether a copy into/out of ``flat`` should try the kernels: a CUDA buffer, unless
    ``GPUCOMM_FUSION_KERNELS=0``."""
    return _wants_kernels(flat.device)


def _wants_kernels(device: torch.device) -> bool:
    if device.type != "cuda":
        return False
    return FUSION_KERNELS.read(None, True)


class TorchCopy:
    """The torch-op copy between tensors of fixed shapes and a flat buffer (``direction`` "pack":
    tensors -> flat; "unpack": flat -> tensors), times ``scale``. ``lean`` (default: CUDA buffers)
    uses the few-launch ``_foreach`` path; otherwise the one-pass CPU path (``torch_pack``)."""

    __slots__ = ("direction", "scale", "lean", "_views_key", "_views")

    def __init__(self, direction: str, scale: float = 1.0, *, lean: bool | None = None) -> None:
        self.direction, self.scale, self.lean = direction, float(scale), lean
        self._views_key: tuple | None = None
        self._views: list[torch.Tensor] = []

    def __call__(self, tensors: Sequence[torch.Tensor], flat: torch.Tensor, stream: Any = None) -> None:
        tensors = rules.tensor_list(self.direction, tensors)
        if flat.is_cuda and stream is not None:
            with torch.cuda.stream(stream):
                without_grad(self._copy, tensors, flat)
        else:
            without_grad(self._copy, tensors, flat)

    def _copy(self, tensors: Sequence[torch.Tensor], flat: torch.Tensor) -> None:
        lean = flat.is_cuda if self.lean is None else self.lean
        if not lean:
            if self.direction == "pack":
                torch_pack(tensors, flat, self.scale)
            else:
                torch_unpack(flat, tensors, self.scale)
            return
        views = self._views_of(tensors, flat)
        if views:
            (_lean_pack if self.direction == "pack" else _lean_unpack)(tensors, flat, views, self.scale)

    def _views_of(self, tensors: Sequence[torch.Tensor], flat: torch.Tensor) -> list[torch.Tensor]:
        """Views of ``flat`` shaped like ``tensors``, back to back (checked and built once per buffer and
        set of shapes: a bucket sends its gradients as they are or as flat views, step by step)."""
        # the tensors' dtype too: a cache hit skips the dtype checks and the conversion rule
        key = (flat.data_ptr(), flat.dtype, flat.numel(), tensors[0].dtype if tensors else None, *map(_SHAPE, tensors))
        if key != self._views_key:
            dtype, total = rules.validate(self.direction, tensors, flat)
            if dtype is None or total == 0:
                return []
            src, dst = (dtype, flat.dtype) if self.direction == "pack" else (flat.dtype, dtype)
            rules.conversion(src, dst, self.scale != 1.0)
            views, offset = [], 0
            for t in tensors:
                views.append(flat[offset : offset + t.numel()].view(t.shape))
                offset += t.numel()
            self._views_key, self._views = key, views
        return self._views


def _lean_pack(tensors: Sequence[torch.Tensor], flat: torch.Tensor, views: list[torch.Tensor], scale: float) -> None:
    if scale == 1.0:
        torch._foreach_copy_(views, tensors)
    elif flat.dtype in (torch.float32, torch.float64):  # the buffer holds the compute dtype: copy, then scale it
        torch._foreach_copy_(views, tensors)
        total = sum(v.numel() for v in views)
        flat[:total].mul_(scale)
    else:  # a half buffer: multiply in float32 (torch's foreach opmath), round once into the buffer
        torch._foreach_copy_(views, torch._foreach_mul(list(tensors), scale))


def _lean_unpack(tensors: Sequence[torch.Tensor], flat: torch.Tensor, views: list[torch.Tensor], scale: float) -> None:
    dtype = tensors[0].dtype
    if scale == 1.0:
        torch._foreach_copy_(list(tensors), views)
    elif dtype in (torch.float32, torch.float64):  # widen exactly, then scale in the target's (compute) dtype
        torch._foreach_copy_(list(tensors), views)
        torch._foreach_mul_(list(tensors), scale)
    else:  # half targets: multiply in float32, round once into them; the buffer is left as it is
        torch._foreach_copy_(list(tensors), torch._foreach_mul(views, scale))


class BucketCopy:
    """A bucket's ``pack`` (scaled by ``pack_scale``) and ``unpack`` (by ``unpack_scale``), with
    kernels on CUDA while they can run (``kernels``: None = ``kernels_wanted``; True forces a try,
    e.g. in Numba's simulator on CPU tensors), torch ops otherwise."""

    def __init__(self, *, pack_scale: float = 1.0, unpack_scale: float = 1.0, kernels: bool | None = None,
                 check_finite: bool = False) -> None:
        self._kernels = kernels
        self._scales = {"pack": float(pack_scale), "unpack": float(unpack_scale)}
        self._check = check_finite
        self._bound: dict[str, Any] = {}
        self._torch = {d: TorchCopy(d, s) for d, s in self._scales.items()}
        self._first_nonfinite = FirstNonFinite()

    def prepare(self, tensor_dtype: torch.dtype, flat_dtype: torch.dtype, device: torch.device) -> None:
        """Compile both directions' kernels now (a DistributedOptimizer builds its buckets before the
        first backward, which would otherwise stall 0.2-1 s per variant at its first bucket). Where
        the kernels cannot run this settles on torch ops now, with the usual warning; argument
        errors surface at the first copy, as before."""
        if self._kernels is None:
            self._kernels = _wants_kernels(device)
        if not self._kernels:
            return

        def compile_both() -> None:
            from ..kernels import compile_variant  # noqa: PLC0415 - imports numba

            compile_variant(tensor_dtype, flat_dtype, self._scales["pack"] != 1.0, device, self._check)
            compile_variant(flat_dtype, tensor_dtype, self._scales["unpack"] != 1.0, device)

        try:
            availability.try_kernels(compile_both)
        except ValueError:  # no kernel for this conversion: the first copy says why, as it always did
            pass

    def pack(self, tensors: Sequence[torch.Tensor], flat: torch.Tensor, stream: Any = None,
             check_out: torch.Tensor | None = None, check_limit: int = 1 << 24) -> None:
        """``tensors`` back to back into ``flat`` (from element 0), times ``pack_scale``. With the
        finite check (``check_finite`` and a 1-element ``check_out``): ``check_out`` := 0 if every
        packed value is finite, else 1 + the index of the first tensor holding Inf or NaN (at most
        ``check_limit``), found by the pack kernel itself or, on torch ops, by one pass over the
        packed buffer; no host sync either way."""
        if check_out is None or not self._check:
            self._run("pack", tensors, flat, stream)
            return
        if self._kernels is None:
            self._kernels = kernels_wanted(flat)
        if self._kernels and availability.try_kernels(
                lambda: self._bound_copy("pack_checked")(tensors, flat, stream, check_out, check_limit)):
            return
        if flat.is_cuda and not availability.kernels_usable():
            availability.count_fallback_copy()
        self._torch["pack"](tensors, flat, stream)
        pieces, pos = [], 0
        for t in tensors:  # the packed values, as they travel (a cast may have overflowed)
            pieces.append(flat[pos:pos + t.numel()])
            pos += t.numel()
        with stream_context(flat, stream):
            self._first_nonfinite(pieces, check_out, check_limit, whole=flat[:pos])

    def checks_in_kernel(self, flat: torch.Tensor) -> bool:
        """Whether a checked ``pack`` into ``flat`` finds non-finite values inside the pack kernel (free:
        no pass of its own), rather than by a separate search over the packed buffer (torch ops)."""
        if not self._check:
            return False
        if self._kernels is None:
            self._kernels = kernels_wanted(flat)
        return bool(self._kernels) and availability.kernels_usable()

    def unpack(self, flat: torch.Tensor, tensors: Sequence[torch.Tensor], stream: Any = None) -> None:
        """Consecutive pieces of ``flat`` into ``tensors``, times ``unpack_scale``."""
        self._run("unpack", tensors, flat, stream)

    def _run(self, direction: str, tensors: Sequence[torch.Tensor], flat: torch.Tensor, stream: Any) -> None:
        if self._kernels is None:
            self._kernels = kernels_wanted(flat)
        if self._kernels and availability.try_kernels(lambda: self._bound_copy(direction)(tensors, flat, stream)):
            return
        if flat.is_cuda and not availability.kernels_usable():
            availability.count_fallback_copy()
        self._torch[direction](tensors, flat, stream)

    def _bound_copy(self, direction: str) -> Any:
        bound = self._bound.get(direction)
        if bound is None:
            from ..kernels.bound import BoundCopy  # noqa: PLC0415 - imports numba

            if direction == "pack_checked":
                bound = BoundCopy("pack", self._scales["pack"], checked=True)
            else:
                bound = BoundCopy(direction, self._scales[direction])
            self._bound[direction] = bound
        return bound


def pack_bucket(tensors: Sequence[torch.Tensor], buffer: torch.Tensor, *, scale: float = 1.0,
                stream: Any = None, validate: bool = True) -> torch.Tensor:
    """Copy ``tensors`` back to back into ``buffer`` (times ``scale``, cast to ``buffer.dtype``) and
    return the filled part, ``buffer[:total]``. CUDA: one kernel launch on ``stream`` (default:
    the current stream; ``validate`` as in ``gpucomm.kernels.pack``), or a few torch launches if the
    kernels cannot run here (decided once per process); CPU: torch ops. For the same bucket every
    step, ``BucketCopy`` costs less host time."""
    tensors = rules.tensor_list("pack", tensors)
    _copy("pack", tensors, buffer, scale, stream, validate)
    return buffer[: sum(t.numel() for t in tensors)]


def unpack_bucket(buffer: torch.Tensor, tensors: Sequence[torch.Tensor], *, scale: float = 1.0,
                  stream: Any = None, validate: bool = True) -> None:
    """Copy consecutive pieces of ``buffer`` into ``tensors`` (times ``scale``, cast to their dtype):
    the reverse of ``pack_bucket``."""
    _copy("unpack", rules.tensor_list("unpack", tensors), buffer, scale, stream, validate)


def _copy(direction: str, tensors: Sequence[torch.Tensor], buffer: torch.Tensor, scale: float, stream: Any,
          validate: bool) -> None:
    def with_kernels() -> None:
        from .. import kernels  # noqa: PLC0415 - imports numba

        if direction == "pack":
            kernels.pack(tensors, buffer, scale=scale, stream=stream, validate=validate)
        else:
            kernels.unpack(buffer, tensors, scale=scale, stream=stream, validate=validate)

    if kernels_wanted(buffer) and availability.try_kernels(with_kernels):
        return
    TorchCopy(direction, scale)(tensors, buffer, stream)  # CUDA: few launches; CPU: one pass


def without_grad(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``fn(*args, **kwargs)`` with autograd off, under ``torch.no_grad()`` only where grad mode is on: a
    backward hook runs with it off already (unless ``create_graph``), and the context costs seven Python
    calls per use."""
    if torch.is_grad_enabled():
        with torch.no_grad():
            return fn(*args, **kwargs)
    return fn(*args, **kwargs)


def stream_context(buffer: torch.Tensor, stream: Any):
    """Run a block's torch ops on ``stream`` when ``buffer`` is a CUDA tensor and a stream is given."""
    if buffer.device.type == "cuda" and stream is not None:
        return torch.cuda.stream(stream)
    return contextlib.nullcontext()


def torch_pack(tensors: Sequence[torch.Tensor], flat: torch.Tensor, scale: float) -> torch.Tensor:
    """The CPU pack: ``tensors`` back to back into ``flat`` times ``scale``, in one pass when it can."""
    dtype, total = rules.validate("pack", tensors, flat)
    out = flat[:total]
    if dtype is None:
        return out
    rules.conversion(dtype, flat.dtype, scale != 1.0)
    if total == 0:
        return out
    pieces = [t.view(-1) for t in tensors]
    if dtype == flat.dtype and (scale == 1.0 or dtype in (torch.float32, torch.float64)):
        # one pass, no temporary: a piece that already lives in its slot (a gradient that is a view
        # of this buffer) is scaled in place, or left alone
        pos = 0
        for piece in pieces:
            n = piece.numel()
            slot = out[pos : pos + n]
            if piece.data_ptr() != slot.data_ptr():
                torch.mul(piece, scale, out=slot) if scale != 1.0 else slot.copy_(piece)
            elif scale != 1.0:
                slot.mul_(scale)
            pos += n
        return out
    joined = torch.cat(pieces)
    if scale != 1.0:  # in float32 (float64 for float64), like the kernels; .to() may return joined itself
        joined = joined.to(rules.compute_dtype(dtype, flat.dtype)).mul_(scale)
    out.copy_(joined)
    return out


def torch_unpack(flat: torch.Tensor, tensors: Sequence[torch.Tensor], scale: float) -> None:
    """The CPU unpack: consecutive pieces of ``flat`` into ``tensors`` times ``scale``."""
    dtype, total = rules.validate("unpack", tensors, flat)
    if dtype is None:
        return
    rules.conversion(flat.dtype, dtype, scale != 1.0)
    if total == 0:
        return
    src = flat[:total]
    pieces = list(torch.split(src, [t.numel() for t in tensors]))
    targets = [t.view(-1) for t in tensors]
    if scale != 1.0 and dtype in (torch.float32, torch.float64) and flat.dtype in _SCALE_IN_TARGET[dtype]:
        # one pass, no temporary: the product is formed in the target's dtype, which is the compute
        # dtype here (float32, or float64), then stored; the fusion buffer is left as it is
        for target, piece in zip(targets, pieces):
            if piece.dtype == target.dtype:
                torch.mul(piece, scale, out=target)
            else:
                target.copy_(piece).mul_(scale)
        return
    if scale != 1.0:  # out of place: the fusion buffer is left as it is
        src = src.to(rules.compute_dtype(flat.dtype, dtype)) * scale
        pieces = list(torch.split(src, [t.numel() for t in tensors]))
    foreach_copy = getattr(torch, "_foreach_copy_", None)
    if foreach_copy is not None:
        foreach_copy(targets, pieces)
    else:
        for target, piece in zip(targets, pieces):
            target.copy_(piece)


# buffer dtypes whose scaled unpack can be computed directly in a float32/float64 target
_SCALE_IN_TARGET = {torch.float32: (torch.float32, torch.float16, torch.bfloat16), torch.float64: (torch.float64,)}
