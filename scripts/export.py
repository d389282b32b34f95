#!/usr/bin/env python
"""Export a checkpoint's base (Hugging Face) and draft (EAGLE-3 / EAGLE-1 / Medusa / DFlash / P-EAGLE) for serving engines."""
import sys

from nemo_spec import entry  # noqa: E402
entry.setup()  # before megatron is imported: quiet its expected TE/Apex fallbacks

from nemo_spec.export.cli import main

if __name__ == "__main__":
    sys.exit(entry.report_user_errors(main)())
