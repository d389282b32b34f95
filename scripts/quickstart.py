#!/usr/bin/env python
"""Quickstart: build the built-in base -> EAGLE-3 transform -> train the draft -> export -> benchmark (cached).

    python scripts/quickstart.py                      # the README's main job (preset small)
    python scripts/quickstart.py --preset tiny --cache_dir /tmp/qs --train_steps 20
"""
import os
import sys

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from nemo_spec import entry  # noqa: E402
entry.setup()  # before megatron is imported: quiet its expected TE/Apex fallbacks

from nemo_spec.base.quickstart import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(entry.report_user_errors(main)())
