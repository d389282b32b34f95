#!/usr/bin/env python
"""One EAGLE-3 (or EAGLE-1/Medusa) training step vs one base forward+backward at the same batch, as a ratio.

    python scripts/benchmark_train.py --hidden 256 --layers 4 --vocab 2048 --batch 4 --seq 256
"""
import argparse
import json
import logging


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--algorithm", default="eagle3", choices=["eagle1", "eagle3", "medusa"])
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--groups", type=int, default=4)
    p.add_argument("--ffn", type=int, default=None, help="default: 4 x hidden x 2/3 rounded to 64")
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--ttt_steps", type=int, default=3)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--device", default=None, help="cpu | cuda (default: cuda when available)")
    a = p.parse_args()
    logging.basicConfig(level=logging.WARNING)

    from nemo_spec import parallel
    from nemo_spec.config import ModelConfig
    from nemo_spec.training.benchmark import benchmark_train_step

    ffn = a.ffn or max(64, (int(a.hidden * 8 / 3) + 63) // 64 * 64)
    cfg = ModelConfig(vocab_size=a.vocab, hidden_size=a.hidden, num_layers=a.layers, num_attention_heads=a.heads,
                      num_query_groups=a.groups, ffn_hidden_size=ffn, max_position_embeddings=max(2048, a.seq + 8))
    parallel.initialize(1)
    try:
        r = benchmark_train_step(cfg, a.algorithm, a.batch, a.seq, iters=a.iters, ttt_steps=a.ttt_steps,
                                 device=a.device)
    finally:
        parallel.destroy()
    print(json.dumps(r.as_dict(), indent=2))
    print(f"{a.algorithm} training step / base forward+backward = {r.ratio:.2f}x (target <= 1.4x)")


if __name__ == "__main__":
    main()
