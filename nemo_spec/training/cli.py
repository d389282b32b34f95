"""Hydra entry point logic for scripts/train_speculative.py (composition happens in the script)."""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Optional

from nemo_spec.config import ConfigError
from nemo_spec.training.config import TrainConfig, train_config_from_dict
from nemo_spec.training.run import TrainResult, train

log = logging.getLogger(__name__)

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"


def typed_config(cfg: Any) -> tuple[TrainConfig, str]:
    """Resolve a Hydra/OmegaConf config into a validated TrainConfig plus its resolved YAML text."""
    from omegaconf import OmegaConf
    from omegaconf.errors import MissingMandatoryValue

    try:
        container = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    except MissingMandatoryValue as e:
        raise ConfigError(f"missing required setting: {e.full_key} (pass {e.full_key}=...)") from e
    container.pop("hydra", None)
    tc = train_config_from_dict(container).validate()
    return tc, OmegaConf.to_yaml(OmegaConf.create(container))


def run_from_hydra(cfg: Any) -> TrainResult:
    """Map the composed config onto TrainConfig, log the resolved config, train."""
    tc, text = typed_config(cfg)
    log.info("resolved config:\n%s", text)
    return train(tc, yaml_text=text)


def compose(overrides: Optional[list[str]] = None, config_name: str = "train") -> Any:
    """Compose conf/<config_name>.yaml with Hydra overrides (no run directory, no logging set-up)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return hydra_compose(config_name=config_name, overrides=list(overrides or []))
