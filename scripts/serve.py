#!/usr/bin/env python
"""Serve models behind an OpenAI-compatible API (config: conf/serve.yaml; Hydra overrides on the command line)."""
import logging

import hydra
from omegaconf import DictConfig, OmegaConf


@hydra.main(config_path="../conf", config_name="serve", version_base=None)
def main(cfg: DictConfig) -> None:
    from nemo_spec.serve.config import ServeConfig
    from nemo_spec.serve.server import run_server

    logging.getLogger().setLevel(str(cfg.log_level).upper())
    run_server(ServeConfig.from_dict(OmegaConf.to_container(cfg, resolve=True), "conf/serve.yaml"))


if __name__ == "__main__":
    main()
