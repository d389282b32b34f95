"""Cost of one draft training step relative to one base forward+backward at the same batch (issue target <= 1.4x).

The default model is the built-in ``small`` base shape (``conf/base/small.yaml``: hidden 192, 12 layers, 3 heads,
1 KV group, FFN 512, vocab 8192), randomly initialised: the model drafts are trained for here. The two steps
are timed alternately (base, draft, base, ...) so that load from other processes hits both alike.

    python -m nemo_spec.training.benchmark                     # EAGLE-3, full draft vocabulary, batch 4 x 256
    python -m nemo_spec.training.benchmark --draft_vocab 2048  # EAGLE-3 with a reduced draft vocabulary
"""
from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

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
    draft_vocab_size: Optional[int] = None
    threads: int = 0

    def as_dict(self) -> Dict[str, object]:
        """Plain dict (for printing/JSON)."""
        return dict(self.__dict__)


def small_base_config() -> ModelConfig:
    """The ModelConfig of the built-in ``small`` base preset (the benchmark's default model)."""
    from nemo_spec.base.presets import load_preset

    return load_preset("small").model_config()


def _time_alternately(fns: Sequence[Callable[[], None]], iters: int, warmup: int,
                      device: torch.device) -> List[List[float]]:
    """Seconds per call of each of ``fns``, called in turn ``iters`` times after ``warmup`` rounds."""
    for _ in range(warmup):
        for fn in fns:
            fn()
    times: List[List[float]] = [[] for _ in fns]
    for _ in range(iters):
        for fn, out in zip(fns, times):
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize()
            out.append(time.perf_counter() - t0)
    return times


def benchmark_train_step(cfg: Optional[ModelConfig] = None, algorithm: str = "eagle3", batch_size: int = 4,
                         seq_len: int = 256, iters: int = 5, warmup: int = 2, ttt_steps: int = 3,
                         num_eagle_layers: int = 1, num_medusa_heads: int = 4, draft_vocab_size: Optional[int] = None,
                         device: Optional[str] = None, seed: int = 0) -> BenchResult:
    """Median time of one draft training step (base no-grad forward + draft forward/backward) vs one base
    forward+backward (LM loss, all base parameters trainable) on the same random batch; ``cfg`` defaults to the
    ``small`` base shape, ``draft_vocab_size`` (EAGLE-3) to the whole base vocabulary."""
    from nemo_spec.models import build_gpt
    from nemo_spec.speculative import SpeculativeTransform
    from nemo_spec.training.module import lm_loss

    cfg = cfg or small_base_config()
    dev = torch.device(device) if device else (torch.device("cuda") if torch.cuda.is_available()
                                               else torch.device("cpu"))
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if dev.type == "cuda" else torch.autocast(
        "cpu", enabled=False)
    torch.manual_seed(seed)
    base = build_gpt(cfg, device=dev)
    ids = torch.randint(0, cfg.vocab_size, (batch_size, seq_len), device=dev)
    mask = torch.ones_like(ids, dtype=torch.bool)
    eagle3 = algorithm == "eagle3"
    spec = SpeculativeTransform(algorithm=algorithm, num_eagle_layers=num_eagle_layers if algorithm != "medusa"
                                else None, num_medusa_heads=num_medusa_heads if algorithm == "medusa" else None,
                                ttt_steps=ttt_steps if eagle3 else None,
                                draft_vocab_size=draft_vocab_size if eagle3 else None)(base)
    spec.to(dev).train()
    if eagle3 and draft_vocab_size:
        spec.set_draft_vocab(torch.bincount(ids.flatten(), minlength=cfg.vocab_size).double())
    base_params = list(base.parameters())

    def base_step() -> None:  # the same base, all of it trainable for this step
        for p in base_params:
            p.requires_grad_(True)
        with autocast:
            loss = lm_loss(base, ids, mask)["loss"]
        loss.backward()
        for p in base_params:
            p.grad = None
            p.requires_grad_(False)

    def draft_step() -> None:
        with autocast:
            loss = spec.training_losses(ids, mask)["loss"]
        loss.backward()
        spec.zero_grad(set_to_none=True)

    tb, td = _time_alternately([base_step, draft_step], iters, warmup, dev)
    base_ms, draft_ms = 1000.0 * statistics.median(tb), 1000.0 * statistics.median(td)
    res = BenchResult(base_ms, draft_ms, draft_ms / base_ms, algorithm, batch_size, seq_len, str(dev),
                      spec.draft_vocab_size if eagle3 else None, torch.get_num_threads())
    log.info("draft %s step %.1f ms vs base fwd+bwd %.1f ms: ratio %.2f", algorithm, draft_ms, base_ms, res.ratio)
    return res


def _parse(argv: Optional[Sequence[str]]) -> Tuple[argparse.Namespace, ModelConfig]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--algorithm", default="eagle3", choices=["eagle1", "eagle3", "medusa"])
    p.add_argument("--preset", default="small", help="built-in base shape to start from (conf/base/<preset>.yaml)")
    for name in ("hidden", "layers", "heads", "groups", "ffn", "vocab"):
        p.add_argument(f"--{name}", type=int, default=None, help="override the preset's value")
    p.add_argument("--draft_vocab", type=int, default=None, help="EAGLE-3 draft vocabulary (default: base vocab)")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--ttt_steps", type=int, default=3)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--device", default=None, help="cpu | cuda (default: cuda when available)")
    a = p.parse_args(argv)
    from nemo_spec.base.presets import load_preset

    d = load_preset(a.preset).model_config().to_dict()
    for name, key in (("hidden", "hidden_size"), ("layers", "num_layers"), ("heads", "num_attention_heads"),
                      ("groups", "num_query_groups"), ("ffn", "ffn_hidden_size"), ("vocab", "vocab_size")):
        if getattr(a, name) is not None:
            d[key] = getattr(a, name)
    if a.hidden is not None or a.heads is not None:
        d.pop("head_dim", None)  # re-derived from hidden / heads
    d["max_position_embeddings"] = max(d["max_position_embeddings"], a.seq + 8)
    return a, ModelConfig.from_dict(d, source="benchmark flags")


def main(argv: Optional[Sequence[str]] = None) -> BenchResult:
    """CLI: print the benchmark result as JSON and the ratio line."""
    a, cfg = _parse(argv)
    logging.basicConfig(level=logging.WARNING)
    if a.threads:
        torch.set_num_threads(a.threads)
    from nemo_spec import parallel

    parallel.initialize(1)
    try:
        r = benchmark_train_step(cfg, a.algorithm, a.batch, a.seq, iters=a.iters, warmup=a.warmup,
                                 ttt_steps=a.ttt_steps, draft_vocab_size=a.draft_vocab, device=a.device)
    finally:
        parallel.destroy()
    print(json.dumps(r.as_dict(), indent=2))
    print(f"{a.algorithm} training step / base forward+backward = {r.ratio:.2f}x (target <= 1.4x)")
    return r


if __name__ == "__main__":
    main()
