"""The slow path of reading a metric: tensors the C hot path does not read directly.

The C core reads an exact ``torch.Tensor`` (or ``nn.Parameter``) itself when it can prove the
element is real: a non-NULL data pointer inside the tensor's storage, and no negative bit
pending. Everything else comes here, once per such metric per call:

- ``resolve(name, tensor)`` returns a plain ``torch.Tensor`` that is safe to read, or raises an
  error naming the metric and the problem. The C side keeps the returned tensor alive until the
  gather kernel is enqueued; stream order makes freeing it afterwards safe.
- ``number(name, value)`` turns any other real number (numpy scalars, ...) into a float and
  refuses complex values and strings.

DTensor (torch.distributed.tensor): the value logged is the global one. A tensor whose
placements are all ``Replicate`` is read from its local shard (no communication: the placement
says every rank holds the same value). Any other placement (``Partial``, e.g. a norm summed over
ranks; ``Shard`` of a one-element tensor) needs a collective, ``full_tensor()``: an all-reduce or
all-gather enqueued on the device with no host wait on NCCL, which every rank of the mesh must
enter at the same ``log()`` call, as every rank does in a data-parallel loop. A rank that logs
such a value alone waits for the others forever: log a non-replicated DTensor on every rank.
"""
from __future__ import annotations

import numbers
import sys
from typing import Any

import torch


def _module_class(module: str, name: str) -> Any:
    """A class of an already imported module, or None: a value cannot be an instance of a class
    whose module nobody imported, and importing torch.distributed here would cost seconds."""
    mod = sys.modules.get(module)
    return getattr(mod, name, None) if mod is not None else None


def _shape(t: torch.Tensor) -> str:
    return str(tuple(t.shape))


def resolve(name: str, value: torch.Tensor) -> torch.Tensor:
    """A plain tensor holding the value of metric `name`, safe to read, or an error."""
    for _ in range(8):                       # each step unwraps one layer; 8 is plenty
        plain = _step(name, value)
        if plain is value:
            return plain
        value = plain
    raise TypeError(f"metric {name!r}: a {type(value).__name__} nested too deeply to read")


def _step(name: str, value: torch.Tensor) -> torch.Tensor:
    cls = type(value)
    fake = _module_class("torch._subclasses.fake_tensor", "FakeTensor")
    if fake is not None and isinstance(value, fake):
        raise TypeError(f"metric {name!r} is a FakeTensor (no data: it only carries a shape and "
                        "dtype, e.g. under FakeTensorMode or torch.compile tracing); log real "
                        "tensors, outside fake mode")
    dtensor = _module_class("torch.distributed.tensor", "DTensor")
    if dtensor is not None and isinstance(value, dtensor):
        return _dtensor(name, value)
    acs = _module_class("torch.distributed._functional_collectives", "AsyncCollectiveTensor")
    if acs is not None and isinstance(value, acs):
        # The result of a functional collective: wait_tensor makes the current stream wait on
        # the collective (no host wait on NCCL) and hands back the plain tensor.
        waited: torch.Tensor = value.trigger_wait()
        return waited
    functional = _module_class("torch._subclasses.functional_tensor", "FunctionalTensor")
    if functional is not None and isinstance(value, functional):
        inner: torch.Tensor = value.elem     # the C++ functional wrapper; unwrapped next step
        return inner
    if cls is not torch.Tensor:
        if hasattr(value, "__tensor_flatten__"):
            raise TypeError(f"metric {name!r} is a {cls.__name__}, a tensor subclass that wraps "
                            "other tensors and has no storage of its own; log the plain tensor "
                            "it holds")
        with torch._C.DisableTorchFunctionSubclass():
            if value.layout == torch.strided and value.device.type != "meta" and \
                    value.numel() == 1 and value.data_ptr() == 0 and \
                    not torch._is_functional_tensor(value):
                raise TypeError(f"metric {name!r} is a {cls.__name__} with no data of its own "
                                "(a wrapper subclass, e.g. made with _make_wrapper_subclass); "
                                "log the plain tensor it holds")
            try:
                plain = value.as_subclass(torch.Tensor)
            except Exception as exc:
                raise TypeError(f"metric {name!r} is a {cls.__name__}, which syncless cannot "
                                f"view as a plain tensor ({str(exc).splitlines()[0]})") from None
        if type(plain) is not torch.Tensor:
            raise TypeError(f"metric {name!r} is a {cls.__name__}, which syncless cannot read")
        return plain
    # An exact torch.Tensor the C side did not prove readable.
    if value.layout != torch.strided:
        raise TypeError(f"metric {name!r} is a {value.layout} tensor; log a dense one-element "
                        "tensor")
    if value.numel() != 1:
        raise ValueError(f"metric {name!r} must hold one element, got shape {_shape(value)}")
    if value.device.type == "meta":
        raise TypeError(f"metric {name!r} is on the meta device (no data: only a shape and "
                        "dtype); log real tensors")
    if value.device.type not in ("cpu", "cuda"):
        raise TypeError(f"metric {name!r} lives on {value.device}; log CPU or CUDA tensors")
    if torch._is_functional_tensor(value):
        # torch.func.functionalize: the wrapper has no storage; its current value lives in the
        # tensor it wraps once pending mutations are applied.
        torch._sync(value)  # type: ignore[attr-defined,no-untyped-call]  # torch's own, private
        return torch._from_functional_tensor(value)
    if value._is_zerotensor():
        return torch.zeros((), dtype=value.dtype, device=value.device)
    if value.is_conj():
        return value.resolve_conj()
    if value.is_neg():
        return value.resolve_neg()           # a copy with the sign applied (one kernel on CUDA)
    storage = value.untyped_storage()
    if storage.data_ptr() == 0 or \
            (value.storage_offset() + 1) * value.element_size() > storage.nbytes():
        raise TypeError(f"metric {name!r} has no data: its storage holds {storage.nbytes()} "
                        f"bytes but the element lies at byte "
                        f"{value.storage_offset() * value.element_size()} (the storage was "
                        "freed or shrunk with resize_)")
    return value


def _dtensor(name: str, value: Any) -> torch.Tensor:
    if value.numel() != 1:
        raise ValueError(f"metric {name!r} must hold one element, got a DTensor of global "
                         f"shape {_shape(value)}")
    replicate = _module_class("torch.distributed.tensor", "Replicate")
    if all(isinstance(p, replicate) for p in value.placements):
        local: torch.Tensor = value.to_local()   # every rank holds the value: no communication
        return local
    # Partial or Shard: one collective, which every rank of the mesh must enter (see above).
    full: torch.Tensor = value.full_tensor()
    return full


#: Scalar types whose every instance is one real number (numpy's real scalar types, added as
#: they are met): the C side reads them with float() and skips number(). Shared with C at bind.
REAL_TYPES: dict[type, bool] = {}


def number(name: str, value: Any) -> float:
    """A real number that is neither a Python float/int nor a tensor, as a float."""
    if isinstance(value, (str, bytes, bytearray)):
        raise TypeError(f"metric {name!r} must be a real number or a one-element tensor, got "
                        f"{type(value).__name__}")
    dtype = getattr(value, "dtype", None)
    kind = getattr(dtype, "kind", None)                # numpy scalars and 0-d arrays
    if kind == "c" or (isinstance(value, numbers.Complex) and
                       not isinstance(value, numbers.Real)):
        raise TypeError(f"metric {name!r} is complex ({type(value).__name__}); log a real number "
                        "such as its .real, .imag or abs()")
    if kind is not None and kind not in "biuf":
        raise TypeError(f"metric {name!r} has numpy dtype {dtype}, which is not a real number")
    if kind is not None and getattr(value, "size", 1) != 1:
        raise ValueError(f"metric {name!r} must hold one element, got shape "
                         f"{tuple(value.shape)}")
    try:
        f = value.__float__()
    except (AttributeError, TypeError, ValueError):
        raise TypeError(f"metric {name!r} must be a real number or a one-element tensor, got "
                        f"{type(value).__name__}") from None
    if not isinstance(f, float):
        raise TypeError(f"metric {name!r}: {type(value).__name__}.__float__ returned "
                        f"{type(f).__name__}")
    numpy = sys.modules.get("numpy")
    if numpy is not None and isinstance(value, numpy.generic) and kind in ("b", "i", "u", "f"):
        REAL_TYPES[type(value)] = True       # a numpy scalar type: its dtype is its type's
    return f


__all__ = ["resolve", "number"]
