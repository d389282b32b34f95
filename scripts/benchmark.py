#!/usr/bin/env python
"""Benchmark our AR + speculative methods vs transformers generate on the same weights; see --help."""
import logging
import sys

from nemo_spec import entry  # noqa: E402
entry.setup()  # before megatron is imported: quiet its expected TE/Apex fallbacks

from nemo_spec.inference.benchmark import main

if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    sys.exit(entry.report_user_errors(main)())
