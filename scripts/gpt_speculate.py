#!/usr/bin/env python
"""Attach an EAGLE-1 / EAGLE-3 / Medusa draft to a GPT checkpoint and save it (see nemo_spec.speculative.cli)."""
import sys

from nemo_spec import entry  # noqa: E402
entry.setup()  # before megatron is imported: quiet its expected TE/Apex fallbacks

from nemo_spec.speculative.cli import main

if __name__ == "__main__":
    sys.exit(entry.report_user_errors(main)())
