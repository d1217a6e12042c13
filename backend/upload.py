"""Host tensors to the GPU without making the host wait for the GPU.

A copy to the device is ordered after every kernel already queued on the stream. From
pageable memory the host takes part in it: a blocking copy (`.to(device)`,
`torch.tensor(..., device=...)`) returns only once the queue has drained, and a
`non_blocking` one may wait as well once it exceeds the driver's staging buffer. Each
such wait leaves the GPU idle while the host then builds the next launches. A copy from
pinned memory is queued like a kernel and the host goes on. The way back (`download`)
likewise queues the copy into pinned memory and waits, when asked, only for the work
queued before it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def upload(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """`t` on `device`; from a CPU tensor to a GPU through pinned memory, queued."""
    if torch.device(device).type != "cuda" or t.is_cuda:
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def upload_list(values: list, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    return upload(torch.tensor(values, dtype=dtype), device)


@dataclass(slots=True)
class Download:
    """A device tensor's copy to the host, queued where it was asked for; `get` waits
    only for the work queued before it, not for what the host queued since."""

    host: torch.Tensor
    done: torch.cuda.Event | None

    def get(self) -> torch.Tensor:
        if self.done is not None:
            self.done.synchronize()
        return self.host


def download(t: torch.Tensor) -> Download:
    if not t.is_cuda:
        return Download(t, None)
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    done = torch.cuda.Event()
    done.record()
    return Download(host, done)
