#!/usr/bin/env python
"""Regenerate a chat dataset's assistant turns with an OpenAI-compatible server (self-distillation data for drafts).

    python scripts/generate_data.py --input data/chats.jsonl --output data/regen.jsonl \
        --base-url http://127.0.0.1:8000/v1 --model default --concurrency 16 --max-tokens 512

Resumable: rerun the same command to continue; finished ids in --output are skipped.
"""
import argparse
import json
import logging
import os
import sys

from nemo_spec import entry  # noqa: E402
entry.setup()  # before megatron is imported: quiet its expected TE/Apex fallbacks

from nemo_spec.datagen import DatagenConfig, DatagenError, generate_data


def parse_args(argv=None) -> DatagenConfig:
    """Command line -> DatagenConfig."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", required=True, help="Daring-Anteater / ShareGPT / messages JSONL file or directory")
    p.add_argument("--output", required=True, help="Daring-Anteater JSONL to append to (resumable)")
    p.add_argument("--model", required=True, help="model id on the server")
    p.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY", "EMPTY"),
                   help="Bearer key (default: $OPENAI_API_KEY or EMPTY)")
    p.add_argument("--format", dest="fmt", default="auto", choices=["auto", "daring_anteater", "sharegpt", "messages"])
    p.add_argument("--system-prompt", default=None, help="system prompt for records that have none")
    p.add_argument("--override-system", action="store_true", help="use --system-prompt for every record")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=512)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--limit", type=int, default=None, help="only the first N records")
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--max-retries", type=int, default=3)
    p.add_argument("--extra-body", type=json.loads, default={}, help='JSON, e.g. \'{"top_k": 20}\'')
    return DatagenConfig(**vars(p.parse_args(argv)))


def main(argv=None) -> int:
    """Run; exit code 1 if any record failed (rerun to retry them)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        stats = generate_data(parse_args(argv))
    except DatagenError as e:
        if entry.debug_requested():
            raise
        entry.print_user_error(e)
        return 2
    except KeyboardInterrupt:
        return 130  # generate_data logged what was written; a rerun resumes
    logging.info("done: %s", {k: v for k, v in vars(stats).items() if k != "failures"})
    return 1 if stats.failed else 0


if __name__ == "__main__":
    sys.exit(entry.report_user_errors(main)())
