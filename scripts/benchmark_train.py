#!/usr/bin/env python
"""One EAGLE-3 (or EAGLE-1/Medusa) training step vs one base forward+backward at the same batch, as a ratio.

Same as ``python -m nemo_spec.training.benchmark`` (default model: the built-in ``small`` base shape)::

    python scripts/benchmark_train.py [--draft_vocab 2048] [--layers 12] [--threads 1] [--algorithm eagle1]
"""
from nemo_spec import entry  # noqa: E402
entry.setup()  # before megatron is imported: quiet its expected TE/Apex fallbacks

from nemo_spec.training.benchmark import main

if __name__ == "__main__":
    entry.report_user_errors(main)()
