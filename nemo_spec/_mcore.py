"""megatron-core version differences (0.15.x and 0.16.x are supported), in one place."""
from __future__ import annotations

import inspect
from typing import Any, Optional

import torch
from megatron.core.transformer import utils as _utils

try:  # 0.16: sharded_state_dict implementations expect metadata["dp_cp_group"]
    from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group as _ensure_dp_cp
except ImportError:  # 0.15: no such key, metadata passes through
    _ensure_dp_cp = None

_DEFAULT_TAKES_TP_GROUP = "tp_group" in inspect.signature(_utils.sharded_state_dict_default).parameters


def ensure_metadata(metadata: Optional[dict]) -> Optional[dict]:
    """``metadata`` as this megatron-core's ``sharded_state_dict`` implementations expect it."""
    return _ensure_dp_cp(metadata) if _ensure_dp_cp is not None else metadata


def sharded_state_dict_default(module: torch.nn.Module, prefix: str, sharded_offsets: tuple,
                               metadata: Optional[dict], tp_group: Any = None) -> dict:
    """megatron's ``sharded_state_dict_default`` (0.16 takes the TP group; 0.15 finds it itself)."""
    if _DEFAULT_TAKES_TP_GROUP:
        return _utils.sharded_state_dict_default(module, prefix, sharded_offsets, metadata, tp_group=tp_group)
    return _utils.sharded_state_dict_default(module, prefix, sharded_offsets, metadata)
