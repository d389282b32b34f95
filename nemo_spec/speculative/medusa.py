"""Medusa heads: K independent heads, each a stack of zero-initialised residual blocks and its own output layer.

State-dict names under ``medusa_heads.``::

    heads.K.blocks.J.linear.weight [h, h], .bias [h]   residual block x + SiLU(W x + b), zero-initialised
    heads.K.output_layer.weight [V, h]                 copy of the base output layer at transform time

Tensor parallelism: the residual blocks are small (h x h) and kept *replicated* on every TP rank (plain
``torch.nn.Linear``; their gradients are identical on all TP ranks because the vocab-parallel output layer
all-reduces its input gradient). Each head's output layer is a vocab-parallel ``ColumnParallelLinear`` sharded
exactly like the base's output layer. Nothing is shared between heads.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel.layers import ColumnParallelLinear
from megatron.core.transformer.module import MegatronModule
from nemo_spec._mcore import ensure_metadata, sharded_state_dict_default

from nemo_spec import parallel
from nemo_spec.config import ModelConfig, SpeculativeConfig
from nemo_spec.models.gpt import gather_vocab
from nemo_spec.models.spec import transformer_config
from nemo_spec.speculative.eagle import _base_output_weight, _tp_group


class ResBlock(torch.nn.Module):
    """x + SiLU(Linear(x)), zero-initialised so a fresh block is the identity."""

    def __init__(self, hidden_size: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(hidden_size, hidden_size, bias=True, dtype=dtype)
        torch.nn.init.zeros_(self.linear.weight)
        torch.nn.init.zeros_(self.linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Residual SiLU block."""
        return x + F.silu(self.linear(x))


class MedusaHead(MegatronModule):
    """One Medusa head: residual blocks then a vocab-parallel output layer."""

    def __init__(self, tcfg, hidden_size: int, vocab_size: int, num_layers: int, init_weight: torch.Tensor) -> None:
        super().__init__(config=tcfg)
        self.blocks = torch.nn.ModuleList([ResBlock(hidden_size, tcfg.params_dtype) for _ in range(num_layers)])
        self.output_layer = ColumnParallelLinear(hidden_size, vocab_size, config=tcfg, init_method=tcfg.init_method,
                                                 bias=False, gather_output=False, skip_bias_add=False)
        with torch.no_grad():
            self.output_layer.weight.copy_(init_weight)

    def forward(self, hidden_sbh: torch.Tensor) -> torch.Tensor:
        """Local (vocab-parallel) logits [s, b, V/tp] for final-normed base hidden [s, b, h]."""
        x = hidden_sbh
        for block in self.blocks:
            x = block(x)
        logits, _ = self.output_layer(x)
        return logits

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: Optional[dict] = None):
        """Replicated residual blocks + vocab-parallel output layer."""
        metadata = ensure_metadata(metadata)
        out = {}
        for j, block in enumerate(self.blocks):
            out.update(sharded_state_dict_default(block, f"{prefix}blocks.{j}.", sharded_offsets, metadata,
                                                  tp_group=_tp_group()))
        out.update(self.output_layer.sharded_state_dict(f"{prefix}output_layer.", sharded_offsets, metadata))
        return out


class MedusaHeads(MegatronModule):
    """K Medusa heads on the base's final-normed hidden states; head k at position t predicts x_{t+k+2}."""

    def __init__(self, model_config: ModelConfig, spec_config: SpeculativeConfig, base: torch.nn.Module) -> None:
        p = next(base.parameters())
        tcfg = transformer_config(model_config.draft_config(), parallel.tp_size(), p.dtype, num_layers=1)
        super().__init__(config=tcfg)

        w = _base_output_weight(base).detach()
        self.num_heads = spec_config.num_medusa_heads
        self.num_layers = spec_config.num_medusa_layers
        self.heads = torch.nn.ModuleList([
            MedusaHead(tcfg, model_config.hidden_size, model_config.vocab_size, self.num_layers, w.clone())
            for _ in range(self.num_heads)
        ])
        self.to(p.device)

    def forward(self, hidden: torch.Tensor, gather: bool = True) -> torch.Tensor:
        """Logits [K, b, s, V] (gathered; vocab-parallel local slice when ``gather=False``) for hidden [b, s, h]."""
        x = hidden.transpose(0, 1)
        outs = []
        for head in self.heads:
            logits = head(x)
            if gather:
                logits = gather_vocab(logits)
            outs.append(logits.transpose(0, 1))
        return torch.stack(outs, 0)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: Optional[dict] = None):
        """Per-head sharded state."""
        metadata = ensure_metadata(metadata)
        out = {}
        for k, head in enumerate(self.heads):
            out.update(head.sharded_state_dict(f"{prefix}heads.{k}.", sharded_offsets, metadata))
        return out
