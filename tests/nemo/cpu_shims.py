"""Test-only work-arounds for NeMo 2.7.3 / megatron-core 0.15.3 code that assumes CUDA, so that ``llm.train`` runs on
a CPU-only machine. Nothing here is in the package: a GPU user needs none of it. Each line names the upstream
file:line that hard-codes CUDA (versions pinned in tests/nemo/requirements.txt)."""
from __future__ import annotations

import contextlib

import torch

_APPLIED = False


class _NoStream:
    """Stand-in for torch.cuda.Stream on CPU (used only as a context for work that then runs synchronously)."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def wait_stream(self, other) -> None:
        pass


def apply() -> None:
    """Install the shims (idempotent; no-op where CUDA exists)."""
    global _APPLIED
    if _APPLIED or torch.cuda.is_available():
        return
    from nemo_spec._cpu import apply_cpu_workarounds

    # the package's own CPU redirection (torch.cuda.current_device / synchronize, megatron's RNG-tracker fork)
    apply_cpu_workarounds()
    # nemo/lightning/megatron_parallel.py:617 `with torch.cuda.stream(torch.cuda.Stream()): self.init_ddp()`
    torch.cuda.Stream = _NoStream  # type: ignore[assignment,misc]
    torch.cuda.stream = lambda stream=None: contextlib.nullcontext()  # type: ignore[assignment]
    # tensors created with device="cuda" in the optimizer and the schedules, e.g.
    # megatron/core/optimizer/optimizer.py:903 `torch.tensor([1.0], dtype=torch.float, device='cuda')` (FP32Optimizer)
    for name in ("tensor", "zeros", "ones", "empty", "full", "arange", "zeros_like", "ones_like", "empty_like"):
        setattr(torch, name, _on_cpu(getattr(torch, name)))
    # nemo/collections/llm/gpt/model/base.py:103 `val.cuda(non_blocking=True)` (gpt_data_step)
    torch.Tensor.cuda = lambda self, *args, **kwargs: self  # type: ignore[assignment]
    # nemo/lightning/pytorch/plugins/data_sampler.py:212
    # `torch.tensor(self.current_global_batch_size, pin_memory=True).to("cuda", non_blocking=True)`
    original_to = torch.Tensor.to

    def to(self, *args, **kwargs):
        if args and _is_cuda(args[0]) and not isinstance(args[0], int):
            args = ("cpu",) + args[1:]
        if "device" in kwargs and _is_cuda(kwargs["device"]):
            kwargs["device"] = "cpu"
        return original_to(self, *args, **kwargs)

    torch.Tensor.to = to  # type: ignore[assignment]
    # nemo/lightning/io/pl.py:495 `assert torch.cuda.is_initialized()` in _fix_tensors_device, run on every resume
    # (pl.py:307); CPU tensors need no device fix
    from nemo.lightning.io import pl as nemo_io_pl

    nemo_io_pl._fix_tensors_device = lambda ckpt: ckpt
    _APPLIED = True


def _is_cuda(device) -> bool:
    return (isinstance(device, str) and device.startswith("cuda")) or (
        isinstance(device, torch.device) and device.type == "cuda") or isinstance(device, int)


def _on_cpu(fn):
    """``fn`` with a CUDA ``device=`` argument replaced by the CPU."""
    def wrapped(*args, **kwargs):
        if "device" in kwargs and _is_cuda(kwargs["device"]):
            kwargs["device"] = "cpu"
        kwargs.pop("pin_memory", None)  # data_sampler.py:212 above: no pinned memory without an accelerator
        return fn(*args, **kwargs)
    wrapped.__wrapped__ = fn
    return wrapped


def mock_data(**kwargs):
    """``llm.MockDataModule`` whose batches carry the causal attention mask a CPU (no Transformer Engine) run needs.

    nemo/collections/llm/gpt/data/mock.py:109 passes ``create_attention_mask`` positionally into
    ``_MockGPTDataset``'s ``seed`` parameter (mock.py:185), so the mask is never created, and
    nemo/collections/llm/gpt/model/base.py:135 then asserts that Transformer Engine is installed."""
    from nemo.collections.llm.gpt.data.mock import MockDataModule, _MockGPTDataset

    class _MaskedMockData(MockDataModule):
        def setup(self, stage: str = "") -> None:
            for split, n in (("train", self.num_train_samples), ("valid", self.num_val_samples),
                             ("test", self.num_test_samples)):
                ds = _MockGPTDataset(self.tokenizer, split, n, self.seq_length, create_attention_mask=True)
                setattr(self, {"train": "_train_ds", "valid": "_validation_ds", "test": "_test_ds"}[split], ds)

    return _MaskedMockData(**kwargs)
