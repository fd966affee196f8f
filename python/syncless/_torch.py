"""The one place that binds the C core to torch: every user of ``_C`` imports it from here.

    from ._torch import _C

The C module itself never imports torch (a DataLoader worker or a CPU-only script pays nothing
for CUDA); this module hands it ``torch.Tensor``, the dtype map (derived from the kinds the C
side defines, ``_C.KINDS``), torch's DLPack exchange table, its raw-stream getter, and the Python
slow paths of ``_metric``.
"""
from __future__ import annotations

import torch

from . import _C, _metric

#: {torch.dtype: kind number of the gather kernel}, for every dtype this torch build has.
DTYPE_KINDS: dict = {getattr(torch, name): kind for name, kind in _C.KINDS.items()
                     if isinstance(getattr(torch, name, None), torch.dtype)}
#: Cells one log() call may carry (the gather kernel's parameter block).
MAX_CELLS: int = _C.MAX_CELLS

#: Whether the DLPack exchange table (torch >= 2.10) is used; else attribute calls.
FAST_PATH: bool = _C.bind_torch(torch.Tensor, torch.nn.Parameter, DTYPE_KINDS,
                                getattr(torch.Tensor, "__dlpack_c_exchange_api__", None),
                                getattr(torch._C, "_cuda_getCurrentRawStream", None),
                                _metric.resolve, _metric.number, _metric.REAL_TYPES)

__all__ = ["_C", "DTYPE_KINDS", "MAX_CELLS", "FAST_PATH"]
