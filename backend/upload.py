"""Host tensors to the GPU without making the host wait for the GPU.

A copy to the device is ordered after every kernel already queued on the stream. From
pageable memory the host takes part in it: a blocking copy (`.to(device)`,
`torch.tensor(..., device=...)`) returns only once the queue has drained, and a
`non_blocking` one may wait as well once it exceeds the driver's staging buffer. Each
such wait leaves the GPU idle while the host then builds the next launches. A copy from
pinned memory is queued like a kernel and the host goes on.
"""

from __future__ import annotations

import torch


def upload(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """`t` on `device`; from a CPU tensor to a GPU through pinned memory, queued."""
    if torch.device(device).type != "cuda" or t.is_cuda:
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def upload_list(values: list, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    return upload(torch.tensor(values, dtype=dtype), device)
