#!/usr/bin/env python
"""Serve models behind an OpenAI-compatible API (config: conf/serve.yaml; Hydra overrides on the command line)."""
import logging

from nemo_spec import entry  # noqa: E402
entry.setup()  # before megatron is imported: quiet its expected TE/Apex fallbacks

import hydra
from omegaconf import DictConfig, OmegaConf


@hydra.main(config_path="../conf", config_name="serve", version_base=None)
@entry.report_user_errors
def main(cfg: DictConfig) -> None:
    from nemo_spec.serve.config import ServeConfig
    from nemo_spec.serve.server import run_server

    logging.getLogger().setLevel(str(cfg.log_level).upper())
    run_server(ServeConfig.from_dict(OmegaConf.to_container(cfg, resolve=True), "conf/serve.yaml"))


if __name__ == "__main__":
    main()
