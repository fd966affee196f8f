"""The one place that binds the C core to torch: every user of ``_C`` imports it from here.

    from ._torch import _C

The C module itself never imports torch (a DataLoader worker or a CPU-only script pays nothing
for CUDA); this module hands it ``torch.Tensor``, the dtype map (derived from the kinds the C
side defines, ``_C.KINDS``), torch's DLPack exchange table, its raw-stream getter, and the Python
slow paths of ``_metric``.
"""
from __future__ import annotations

from typing import Callable

import torch

from . import _C, _metric

#: {torch.dtype: kind number of the gather kernel}, for every dtype this torch build has.
DTYPE_KINDS: dict[torch.dtype, int] = {getattr(torch, name): kind for name, kind in _C.KINDS.items()
                     if isinstance(getattr(torch, name, None), torch.dtype)}
#: torch.cuda.is_initialized, typed (torch leaves it unannotated): a flag check that never
#: initialises CUDA, cheap enough for every call.
cuda_initialized: Callable[[], bool] = torch.cuda.is_initialized
#: Cells one log() call may carry (the gather kernel's parameter block).
MAX_CELLS: int = _C.MAX_CELLS

#: Whether the DLPack exchange table (torch >= 2.10) is used; else attribute calls.
FAST_PATH: bool = _C.bind_torch(torch.Tensor, torch.nn.Parameter, DTYPE_KINDS,
                                getattr(torch.Tensor, "__dlpack_c_exchange_api__", None),
                                getattr(torch._C, "_cuda_getCurrentRawStream", None),
                                _metric.resolve, _metric.number, _metric.REAL_TYPES)



def _neg_probes() -> list[torch.Tensor]:
    """Tensors with and without the negative bit, as varied as the metrics a loop logs (views,
    autograd, parameters, inference mode, other dtypes), for ``_C.learn_neg_bit``."""
    a, z = torch.tensor([2.0, 3.0]), torch.tensor([1 + 2j])
    leaf = torch.ones(1, requires_grad=True)
    neg = [torch._neg_view(a), torch._neg_view(a)[1], z.conj().imag, torch._neg_view(leaf),
           torch._neg_view(torch.ones(1, dtype=torch.int64))]
    plain = [a, a[1], z.imag, leaf, leaf * 2, torch.nn.Parameter(torch.ones(1)),
             torch._neg_view(torch._neg_view(a)), torch.ones(1, dtype=torch.float16)]
    with torch.inference_mode():
        neg.append(torch._neg_view(torch.ones(1)))
        plain.append(torch.ones(1))
    return neg + plain


def _learn_neg_bit() -> bool:
    try:
        probes = _neg_probes()
    except (AttributeError, RuntimeError):      # a torch without _neg_view: ask is_neg()
        return False
    return _C.learn_neg_bit(probes)


#: Whether the C reader finds a tensor's negative bit in its key set (else it calls is_neg()).
NEG_BIT_READ: bool = _learn_neg_bit()

__all__ = ["_C", "DTYPE_KINDS", "MAX_CELLS", "FAST_PATH", "NEG_BIT_READ", "cuda_initialized"]
