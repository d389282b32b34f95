"""Cost of one draft training step relative to one base forward+backward at the same batch (issue target <= 1.4x)."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable, Dict, Optional

import torch

from nemo_spec.config import ModelConfig

log = logging.getLogger(__name__)


@dataclass
class BenchResult:
    """Median milliseconds per step for the base fwd+bwd and the draft training step, and their ratio."""

    base_ms: float
    draft_ms: float
    ratio: float
    algorithm: str
    batch_size: int
    seq_len: int
    device: str

    def as_dict(self) -> Dict[str, object]:
        """Plain dict (for printing/JSON)."""
        return dict(self.__dict__)


def _time(fn: Callable[[], None], iters: int, warmup: int, device: torch.device) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    times.sort()
    return 1000.0 * times[len(times) // 2]


def benchmark_train_step(cfg: ModelConfig, algorithm: str = "eagle3", batch_size: int = 4, seq_len: int = 256,
                         iters: int = 5, warmup: int = 2, ttt_steps: int = 3, num_eagle_layers: int = 1,
                         num_medusa_heads: int = 4, device: Optional[str] = None, seed: int = 0) -> BenchResult:
    """Median time of one draft training step (base no-grad forward + draft forward/backward) vs one base
    forward+backward (LM loss, all base parameters trainable) on the same random batch."""
    from nemo_spec.models import build_gpt
    from nemo_spec.speculative import SpeculativeTransform
    from nemo_spec.training.module import lm_loss

    dev = torch.device(device) if device else (torch.device("cuda") if torch.cuda.is_available()
                                               else torch.device("cpu"))
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if dev.type == "cuda" else torch.autocast(
        "cpu", enabled=False)
    torch.manual_seed(seed)
    base = build_gpt(cfg, device=dev)
    ids = torch.randint(0, cfg.vocab_size, (batch_size, seq_len), device=dev)
    mask = torch.ones_like(ids, dtype=torch.bool)

    def base_step() -> None:
        with autocast:
            loss = lm_loss(base, ids, mask)["loss"]
        loss.backward()
        base.zero_grad(set_to_none=True)

    base_ms = _time(base_step, iters, warmup, dev)
    spec = SpeculativeTransform(algorithm=algorithm, num_eagle_layers=num_eagle_layers if algorithm != "medusa"
                                else None, num_medusa_heads=num_medusa_heads if algorithm == "medusa" else None,
                                ttt_steps=ttt_steps if algorithm == "eagle3" else None)(base)  # after base timing
    spec.to(dev).train()

    def draft_step() -> None:
        with autocast:
            loss = spec.training_losses(ids, mask)["loss"]
        loss.backward()
        spec.zero_grad(set_to_none=True)

    draft_ms = _time(draft_step, iters, warmup, dev)
    res = BenchResult(base_ms, draft_ms, draft_ms / base_ms, algorithm, batch_size, seq_len, str(dev))
    log.info("draft %s step %.1f ms vs base fwd+bwd %.1f ms: ratio %.2f", algorithm, draft_ms, base_ms, res.ratio)
    return res
