#!/usr/bin/env python
"""Benchmark our AR + speculative methods vs transformers generate on the same weights; see --help."""
import logging
import sys

from nemo_spec.inference.benchmark import main

if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    sys.exit(main())
