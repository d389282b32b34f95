"""Speculative-decoding drafts (EAGLE-1, EAGLE-3, Medusa) attached to a frozen megatron-core GPTModel."""
from nemo_spec.checkpoint import tp as _tp
from nemo_spec.speculative.eagle import EagleDraft, TTTContext, count_tokens
from nemo_spec.speculative.medusa import MedusaHeads
from nemo_spec.speculative.model import EAGLE_PREFIX, MEDUSA_PREFIX, SpeculativeGPT
from nemo_spec.speculative.transform import SpeculativeTransform, model_config_from_megatron

# TP sharding of draft parameters (split/merge of full state dicts). Draft decoder layers reuse the base rules
# (linear_qkv column, linear_proj/linear_fc2 row, gated linear_fc1); output layers are vocab-parallel.
_tp.register_rule(r"eagle_module\.fc\.(weight|bias)$", _tp.REPLICATED, first=True)
_tp.register_rule(r"eagle_module\.layers\.\d+\.hidden_norm\.(weight|bias)$", _tp.REPLICATED, first=True)
_tp.register_rule(r"eagle_module\.d2t$", _tp.REPLICATED, first=True)
_tp.register_rule(r"medusa_heads\.heads\.\d+\.blocks\.\d+\.linear\.(weight|bias)$", _tp.REPLICATED, first=True)
_tp.register_rule(r"(eagle_module|medusa_heads\.heads\.\d+)\.output_layer\.weight$", _tp.VOCAB, first=True)

__all__ = ["EagleDraft", "MedusaHeads", "SpeculativeGPT", "SpeculativeTransform", "TTTContext", "EAGLE_PREFIX",
           "MEDUSA_PREFIX", "count_tokens", "model_config_from_megatron"]
