#!/usr/bin/env python
"""Build (or fetch from the cache) the built-in base model.

    python scripts/build_base.py                                   # default preset: small
    python scripts/build_base.py base=tiny cache_dir=/tmp/nemo_spec_cache
    python scripts/build_base.py base=base seed=1 force=true
"""
import logging
import os

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from nemo_spec import entry  # noqa: E402
entry.setup()  # before megatron is imported: quiet its expected TE/Apex fallbacks

import hydra  # noqa: E402
from omegaconf import DictConfig  # noqa: E402


@hydra.main(version_base="1.3", config_path="../conf", config_name="build_base")
@entry.report_user_errors
def main(cfg: DictConfig) -> None:
    from nemo_spec.base.build import run_from_config, summary

    logging.getLogger("nemo_spec").setLevel(logging.INFO)
    result = run_from_config(cfg)
    print(summary(result), flush=True)


if __name__ == "__main__":
    main()
