#!/usr/bin/env python
"""Serving throughput at 1/4/8/16 concurrent streams vs sequential requests, or Poisson arrivals per scheduler.

Against a running server:      python scripts/benchmark_serve.py --base-url http://127.0.0.1:8000/v1 --model default
Serving a checkpoint in-process: python scripts/benchmark_serve.py --checkpoint /ckpt/model --max-batch 16 [--method eagle]
Old batcher vs continuous batching under Poisson arrivals (in-process, same arrivals for both):
    python scripts/benchmark_serve.py --checkpoint /ckpt/model --poisson 2,4,8 --requests 32
    ... the same rates from 16 closed-loop clients (each waits for its response, then an exponential think time):
    python scripts/benchmark_serve.py --checkpoint /ckpt/model --poisson 2,4,8 --requests 48 --clients 16
A 4-token request sent 0.4 s into a 250-token one (its time to first token in engine steps, per scheduler):
    python scripts/benchmark_serve.py --checkpoint /ckpt/model --late 250 4
"""
import argparse
import json
import logging
import sys
from nemo_spec import entry  # noqa: E402
entry.setup()  # before megatron is imported: quiet its expected TE/Apex fallbacks
from nemo_spec.fsutil import write_text_atomic  # noqa: E402



def main(argv=None) -> int:
    """Run the benchmark, print the table and the speed-up at 8 streams; optionally write JSON."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default=None)
    p.add_argument("--model", default="default")
    p.add_argument("--api-key", default="EMPTY")
    p.add_argument("--checkpoint", default=None, help="serve this checkpoint in-process on 127.0.0.1 instead")
    p.add_argument("--method", default="ar")
    p.add_argument("--options", type=json.loads, default={}, help="generate() options as JSON")
    p.add_argument("--max-batch", type=int, default=16)
    p.add_argument("--levels", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4, 8, 16])
    p.add_argument("--requests", type=int, default=None, help="requests per level (default 2x level, >= 8)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--chat", action="store_true", help="use chat.completions instead of completions")
    p.add_argument("--json", default=None, help="write results here")
    p.add_argument("--poisson", type=lambda s: [float(x) for x in s.split(",")], default=None,
                   help="arrival rates (requests/s): compare the schedulers (batch vs continuous) under Poisson load")
    p.add_argument("--clients", type=int, default=0,
                   help="--poisson: N closed-loop clients, each sending its next request an exponential think time "
                        "(mean N / rate) after its previous response (at most N in flight), instead of open-loop "
                        "arrivals (0)")
    p.add_argument("--rounds", type=int, default=1,
                   help="--poisson: replay the arrivals this many times per rate, the schedulers alternating (their "
                        "order reversed every other round); throughput and percentiles pool the rounds")
    p.add_argument("--schedulers", default="batch,continuous")
    p.add_argument("--max-tokens-range", type=int, nargs=2, metavar=("LO", "HI"), default=None,
                   help="--poisson: each request's max_tokens drawn uniformly from [LO, HI] (mixed lengths, the same "
                        "for every scheduler) instead of --max-tokens")
    p.add_argument("--late", type=int, nargs=2, metavar=("LONG", "SHORT"), default=None,
                   help="time to first token of a SHORT-token request sent --late-delay s into a LONG-token one, per "
                        "scheduler (in engine steps: the long request's median streaming gap)")
    p.add_argument("--late-delay", type=float, default=0.4)
    p.add_argument("--late-after-tokens", type=int, default=None,
                   help="--late: send the short request once the long one has streamed this many tokens (instead of "
                        "--late-delay seconds: independent of the machine's speed)")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from nemo_spec.serve.benchmark import format_table, results_dict, run_benchmark

    if a.late:
        if not a.checkpoint:
            p.error("--late needs --checkpoint (each scheduler is served in-process)")
        from dataclasses import asdict

        from nemo_spec import parallel
        from nemo_spec.serve.benchmark import format_late, late_request

        parallel.initialize(1)
        res = late_request(a.checkpoint, a.late[0], a.late[1], a.late_delay, a.method, a.options, a.max_batch,
                           a.schedulers.split(","), after_tokens=a.late_after_tokens)
        print(format_late(res))
        if a.json:
            write_text_atomic(a.json, json.dumps([asdict(r) for r in res], indent=2))
        return 0
    if a.poisson:
        if not a.checkpoint:
            p.error("--poisson needs --checkpoint (each scheduler is served in-process)")
        from dataclasses import asdict

        from nemo_spec import parallel
        from nemo_spec.serve.benchmark import compare_schedulers, format_poisson

        parallel.initialize(1)
        budget = tuple(a.max_tokens_range) if a.max_tokens_range else a.max_tokens
        if a.max_tokens_range and not 1 <= a.max_tokens_range[0] <= a.max_tokens_range[1]:
            p.error(f"--max-tokens-range {a.max_tokens_range[0]} {a.max_tokens_range[1]}: need 1 <= LO <= HI")
        if a.clients < 0:
            p.error(f"--clients {a.clients}: need >= 0 (0: open-loop arrivals)")
        if a.rounds < 1:
            p.error(f"--rounds {a.rounds}: need >= 1")
        res = compare_schedulers(a.checkpoint, a.poisson, a.requests or 32, budget, a.method, a.options,
                                 a.max_batch, a.schedulers.split(","), clients=a.clients, rounds=a.rounds)
        print(format_poisson(res))
        if a.json:
            write_text_atomic(a.json, json.dumps([asdict(r) for r in res], indent=2))
        return 0

    server = None
    if a.checkpoint:
        from nemo_spec import parallel
        from nemo_spec.serve import ModelSpec, ServeConfig
        from nemo_spec.serve.server import ServerThread

        parallel.initialize(1)
        spec = ModelSpec(name=a.model, path=a.checkpoint, method=a.method, options=a.options, max_batch=a.max_batch)
        server = ServerThread(ServeConfig(models=[spec], max_queue=max(64, 2 * max(a.levels)))).start()
        a.base_url = server.url + "/v1"
    elif not a.base_url:
        p.error("give --base-url or --checkpoint")
    try:
        res = run_benchmark(a.base_url, a.model, a.levels, a.requests, a.max_tokens, api_key=a.api_key, chat=a.chat,
                            client_process=server is not None)
    finally:
        if server is not None:
            server.stop()
    print(format_table(res))
    at8 = [r for r in res if r.concurrency == 8]
    if at8:
        print(f"throughput at 8 concurrent streams = {at8[0].speedup_vs_sequential:.2f}x sequential")
    if a.json:
        write_text_atomic(a.json, json.dumps(results_dict(res), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(entry.report_user_errors(main)())
