#!/usr/bin/env python
"""Attach an EAGLE-1 / EAGLE-3 / Medusa draft to a GPT checkpoint and save it (see nemo_spec.speculative.cli)."""
import sys

from nemo_spec.speculative.cli import main

if __name__ == "__main__":
    sys.exit(main())
