"""Training callbacks: acceptance length (tau) of the draft measured by real chain speculative generation."""
from __future__ import annotations

import logging
from typing import Any, Callable, List, Optional, Sequence, Tuple

import lightning.pytorch as pl
import torch

log = logging.getLogger(__name__)


def measure_tau(model: torch.nn.Module, prompts: Sequence[Sequence[int]], depth: int = 4, max_new_tokens: int = 24,
                method: Optional[str] = None) -> float:
    """Acceptance length of greedy chain speculative decoding on ``prompts``: tokens per decoding step (accepted
    drafts + 1), prefill excluded, pooled over all steps of all prompts. ``depth`` is the chain length of the
    autoregressive drafts (EAGLE); parallel drafts (Medusa, P-EAGLE, DFlash) propose all they were trained for."""
    from nemo_spec.inference import SamplingParams, generate

    if method is None:
        alg = getattr(model, "algorithm", None)
        method = {"medusa": "medusa", "peagle": "peagle", "dflash": "dflash"}.get(alg, "eagle")
    params = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens)
    options = {"num_draft_tokens": depth, "depth": depth, "ignore_eos": True}
    if method in ("medusa", "peagle", "dflash"):
        # one draft forward proposes everything the draft was trained for (Medusa's heads, P-EAGLE's depths,
        # DFlash's B - 1 mask slots): tau over all of it, not a chain depth meant for autoregressive drafts
        options = {"ignore_eos": True}
    with torch.no_grad():
        results = generate(model, [list(p) for p in prompts], params, method=method, options=options)
    steps = sum(sum(r.stats["accept_hist"]) for r in results)
    accepted = sum(m * c for r in results for m, c in enumerate(r.stats["accept_hist"]))
    return (accepted + steps) / steps if steps else 1.0


class AcceptanceLengthCallback(pl.Callback):
    """After each validation, run greedy chain speculative generation on held-out prompts and log ``val_tau``."""

    def __init__(self, prompts_fn: Callable[[], List[List[int]]], depth: int = 4, max_new_tokens: int = 24,
                 measure_at_start: bool = True) -> None:
        self.prompts_fn = prompts_fn
        self.depth = depth
        self.max_new_tokens = max_new_tokens
        self.measure_at_start = measure_at_start
        self.history: List[Tuple[int, float]] = []  # (global step, tau)

    def _measure(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> Optional[float]:
        if not getattr(pl_module, "is_speculative", False):
            return None
        prompts = self.prompts_fn()
        if not prompts:
            return None
        tau = measure_tau(pl_module.model, prompts, self.depth, self.max_new_tokens)
        self.history.append((int(trainer.global_step), tau))
        return tau

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Baseline tau of the draft before (further) training; written to the loggers directly."""
        if not self.measure_at_start or trainer.global_step > 0:
            return
        tau = self._measure(trainer, pl_module)
        if tau is not None:
            for lg in trainer.loggers:
                lg.log_metrics({"val_tau": tau}, step=trainer.global_step)
            log.info("untrained draft: acceptance length tau=%.3f", tau)

    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking:
            return
        tau = self._measure(trainer, pl_module)
        if tau is None:
            return
        pl_module.log("val_tau", torch.tensor(tau), prog_bar=True, batch_size=1, sync_dist=True)  # same on every rank
        alg = getattr(pl_module.model, "algorithm", None)
        how = f"chain depth {self.depth}" if alg in ("eagle1", "eagle3") else f"{alg}: every trained draft slot"
        log.info("step %d: acceptance length tau=%.3f (%s)", trainer.global_step, tau, how)
