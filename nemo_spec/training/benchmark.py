"""Cost of one draft training step relative to one base forward+backward at the same batch (issue target <= 1.4x).

The default model is the built-in ``small`` base shape (``conf/base/small.yaml``: hidden 192, 12 layers, 3 heads,
1 KV group, FFN 512, vocab 8192), randomly initialised: the model drafts are trained for here. The two steps
are timed alternately (base, draft, base, ...) so that load from other processes hits both alike.

    python -m nemo_spec.training.benchmark                     # EAGLE-3, full draft vocabulary, batch 4 x 256
    python -m nemo_spec.training.benchmark --draft_vocab 2048  # EAGLE-3 with a reduced draft vocabulary
    python -m nemo_spec.training.benchmark --preset smollm2    # SmolLM2-135M's shape (random weights, no download)
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


#: the trainer precisions timed here: fp32, or bf16 autocast around both steps (Lightning's names)
PRECISIONS = ("32-true", "bf16-mixed")


@dataclass
class BenchResult:
    """Median milliseconds per step for the base fwd+bwd and the draft training step, their ratio, and the peak
    memory during each (CPU: resident set size of the process, sampled; CUDA: max allocated), in MiB."""

    base_ms: float
    draft_ms: float
    ratio: float
    algorithm: str
    batch_size: int
    seq_len: int
    device: str
    draft_vocab_size: Optional[int] = None
    threads: int = 0
    base_peak_mib: float = 0.0
    draft_peak_mib: float = 0.0
    idle_mib: float = 0.0  # before the first step: weights, inputs, the interpreter
    formulation: str = "linear"
    precision: str = "32-true"  # one of PRECISIONS

    def as_dict(self) -> Dict[str, object]:
        """Plain dict (for printing/JSON)."""
        return dict(self.__dict__)


def _release_free_heap() -> None:
    """Return freed heap memory to the OS (glibc ``malloc_trim``) so RSS reflects live memory; no-op elsewhere."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


class PeakMemory:
    """Peak memory per labelled phase: CUDA max allocated, or on CPU the process RSS sampled every ``period_s``
    by a background thread (RSS cannot be reset, so phases are sampled, not read from ru_maxrss; freed heap is
    returned to the OS before each phase)."""

    def __init__(self, device: torch.device, period_s: float = 0.002) -> None:
        self.device, self.period_s = device, period_s
        self.peaks: Dict[str, int] = {}
        self._label: Optional[str] = None
        self._stop = False
        self._thread = None
        if device.type != "cuda":
            import threading

            import psutil

            self._proc = psutil.Process()
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()

    def now(self) -> int:
        """Current bytes (allocated on CUDA, RSS on CPU)."""
        if self.device.type == "cuda":
            return int(torch.cuda.memory_allocated(self.device))
        return int(self._proc.memory_info().rss)

    def _sample(self) -> None:
        while not self._stop:
            label = self._label
            if label is not None:
                self.peaks[label] = max(self.peaks.get(label, 0), self.now())
            time.sleep(self.period_s)

    def measure(self, label: str, fn: Callable[[], None]) -> None:
        """Run ``fn`` and record the peak memory during it under ``label``."""
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            fn()
            peak = int(torch.cuda.max_memory_allocated(self.device))
        else:
            _release_free_heap()  # memory the previous phase freed must not count towards this one
            self._label = label
            fn()
            self._label = None
            peak = self.now()
        self.peaks[label] = max(self.peaks.get(label, 0), peak)

    def close(self) -> None:
        """Stop the sampler."""
        self._stop = True
        if self._thread is not None:
            self._thread.join()


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
                         device: Optional[str] = None, seed: int = 0, reference: bool = False,
                         draft_only: bool = False, precision: Optional[str] = None) -> BenchResult:
    """Median time of one draft training step (base no-grad forward + draft forward/backward) vs one base
    forward+backward (LM loss, all base parameters trainable) on the same random batch; ``cfg`` defaults to the
    ``small`` base shape, ``draft_vocab_size`` (EAGLE-3) to the whole base vocabulary. ``reference``: time the
    quadratic-memory formulation of the losses instead (explicit TTT masks, full base logits). ``draft_only``: time
    and measure the draft step alone (base time, peak and the ratio are reported as 0; for memory runs at lengths
    where the base step takes minutes)."""
    from nemo_spec.models import build_gpt
    from nemo_spec.speculative import SpeculativeTransform
    from nemo_spec.training.module import lm_loss

    cfg = cfg or small_base_config()
    dev = torch.device(device) if device else (torch.device("cuda") if torch.cuda.is_available()
                                               else torch.device("cpu"))
    if precision is None:  # what the recipe's trainer presets use: trainer=gpu bf16 autocast, trainer=cpu fp32
        precision = "bf16-mixed" if dev.type == "cuda" else "32-true"
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be {' or '.join(PRECISIONS)}, got {precision!r}")
    autocast = torch.autocast(dev.type, dtype=torch.bfloat16, enabled=precision == "bf16-mixed")
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

    from nemo_spec.speculative import losses as losses_mod

    mem = PeakMemory(dev)
    idle = mem.now()
    previous = losses_mod.REFERENCE_FORMULATION
    losses_mod.REFERENCE_FORMULATION = reference
    try:
        steps = [lambda: mem.measure("draft", draft_step)]
        if not draft_only:
            steps.insert(0, lambda: mem.measure("base", base_step))
        times = _time_alternately(steps, iters, warmup, dev)
        tb, td = ([0.0], times[0]) if draft_only else times
    finally:
        losses_mod.REFERENCE_FORMULATION = previous
        mem.close()
    base_ms, draft_ms = 1000.0 * statistics.median(tb), 1000.0 * statistics.median(td)
    mib = 1024.0 * 1024.0
    res = BenchResult(base_ms, draft_ms, draft_ms / base_ms if base_ms else 0.0, algorithm, batch_size, seq_len, str(dev),
                      spec.draft_vocab_size if eagle3 else None, torch.get_num_threads(),
                      round(mem.peaks.get("base", 0) / mib, 1), round(mem.peaks.get("draft", 0) / mib, 1),
                      round(idle / mib, 1), "reference" if reference else "linear", precision)
    log.info("draft %s step %.1f ms vs base fwd+bwd %.1f ms: ratio %.2f", algorithm, draft_ms, base_ms, res.ratio)
    return res


def _parse(argv: Optional[Sequence[str]]) -> Tuple[argparse.Namespace, ModelConfig]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--algorithm", default="eagle3", choices=["eagle1", "eagle3", "medusa"])
    p.add_argument("--preset", default="small", help="base shape to start from: a built-in preset "
                   "(conf/base/<preset>.yaml) or a pretrained base's shape (smollm2)")
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
    p.add_argument("--precision", default=None, choices=PRECISIONS,
                   help="bf16-mixed: bf16 autocast around both steps (default: bf16-mixed on CUDA, 32-true on CPU, "
                        "as trainer=gpu / trainer=cpu)")
    p.add_argument("--reference", action="store_true",
                   help="time the quadratic-memory reference formulation (explicit TTT masks, full base logits)")
    p.add_argument("--draft_only", action="store_true",
                   help="run only the draft step (its time and peak memory; no base step, no ratio)")
    a = p.parse_args(argv)
    from nemo_spec.base.pretrained import PRETRAINED_SHAPES
    from nemo_spec.base.presets import load_preset

    if a.preset in PRETRAINED_SHAPES:
        d = PRETRAINED_SHAPES[a.preset]().to_dict()
    else:
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
                                 ttt_steps=a.ttt_steps, draft_vocab_size=a.draft_vocab, device=a.device,
                                 reference=a.reference, draft_only=a.draft_only, precision=a.precision)
    finally:
        parallel.destroy()
    print(json.dumps(r.as_dict(), indent=2))
    if a.draft_only:
        print(f"{a.algorithm} training step {r.draft_ms:.0f} ms; peak memory {r.draft_peak_mib:.0f} MiB "
              f"(idle {r.idle_mib:.0f} MiB)")
    else:
        print(f"{a.algorithm} training step / base forward+backward = {r.ratio:.2f}x (target <= 1.4x); peak memory "
              f"draft step {r.draft_peak_mib:.0f} MiB, base step {r.base_peak_mib:.0f} MiB (idle {r.idle_mib:.0f} MiB)")
    return r


if __name__ == "__main__":
    main()
