#!/usr/bin/env python
"""Generate text (AR or speculative: eagle, eagle_tree, medusa, draft_model, prompt_lookup, suffix, peagle, peagle_tree,
dflash, dflash_tree); see --help."""
import logging
import sys

from nemo_spec import entry  # noqa: E402
entry.setup()  # before megatron is imported: quiet its expected TE/Apex fallbacks

from nemo_spec.inference.cli import main

if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    sys.exit(entry.report_user_errors(main)())
