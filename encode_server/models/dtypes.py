"""The one table of embedding dtypes: names on the wire and in settings, torch dtypes, raw byte views.

bfloat16 has no numpy type, so its raw bytes travel (and are viewed) as their 16-bit patterns.
"""

from __future__ import annotations

import numpy as np
import torch

#: Name (settings, responses, wire headers) -> torch dtype.
DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
#: torch dtype -> name.
DTYPE_NAMES: dict[torch.dtype, str] = {dtype: name for name, dtype in DTYPES.items()}
#: Name -> numpy dtype of the payload's little-endian elements (bfloat16 as its 16-bit pattern).
PAYLOAD_DTYPES: dict[str, np.dtype] = {"float32": np.dtype("<f4"), "float16": np.dtype("<f2"),
                                       "bfloat16": np.dtype("<u2")}


def storage_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype whose elements have the same bytes and that numpy can hold (int16 for bfloat16)."""
    return torch.int16 if dtype == torch.bfloat16 else dtype


def raw_bytes(tensor: torch.Tensor) -> memoryview:
    """A CPU tensor's bytes without a copy (contiguous first; the host is little-endian)."""
    tensor = tensor.contiguous()
    return memoryview(tensor.view(storage_dtype(tensor.dtype)).numpy()).cast("B")
