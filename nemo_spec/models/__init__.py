"""megatron-core GPT models with the project's layer spec."""
from nemo_spec.models.attention import AttnContext, KVCache, SDPACoreAttention
from nemo_spec.models.gpt import (GPTOutput, build_gpt, gather_vocab, gpt_forward, is_speculative, model_config,
                                  new_kv_cache, unwrap, unwrap_speculative)

__all__ = ["AttnContext", "KVCache", "SDPACoreAttention", "GPTOutput", "build_gpt", "gather_vocab", "gpt_forward",
           "is_speculative", "model_config", "new_kv_cache", "unwrap", "unwrap_speculative"]
