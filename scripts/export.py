#!/usr/bin/env python
"""Export a checkpoint's base (Hugging Face) and draft (EAGLE-3 / EAGLE-1 / Medusa) for serving engines."""
import sys

from nemo_spec.export.cli import main

if __name__ == "__main__":
    sys.exit(main())
