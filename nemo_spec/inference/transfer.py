"""Host <-> device transfers of the generation hot path: host data goes up without a sync, results come back once."""
from __future__ import annotations

import contextlib
from typing import Any, Iterator, Sequence

import torch


def h2d(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A CPU tensor on ``device`` without a device sync (pinned, non-blocking copy on CUDA)."""
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def tensor(data: Sequence[Any], device: torch.device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """``torch.tensor(data)`` on ``device`` without a device sync."""
    return h2d(torch.tensor(data, dtype=dtype), device)


@contextlib.contextmanager
def allowed_sync() -> Iterator[None]:
    """Mark the one intended device -> host read of a step (lifts ``torch.cuda.set_sync_debug_mode`` inside)."""
    if not torch.cuda.is_available():
        yield
        return
    mode = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode(0)
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(mode)
