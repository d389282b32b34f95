#!/usr/bin/env python
"""Verify an export: read it back through every engine's conformance reader and compare with the checkpoint."""
import sys

from nemo_spec import entry  # noqa: E402
entry.setup()  # before megatron is imported: quiet its expected TE/Apex fallbacks

from nemo_spec.export.cli import verify_main

if __name__ == "__main__":
    sys.exit(entry.report_user_errors(verify_main)())
