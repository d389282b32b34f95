"""Helpers for the speculative tests: build transformed tiny models, expected parameter counts, chain drafting."""
from __future__ import annotations

from typing import Dict, List

import torch

from nemo_spec.config import ModelConfig, SpeculativeConfig
from nemo_spec.models import AttnContext, build_gpt
from nemo_spec.speculative import SpeculativeTransform

ALG_KWARGS: Dict[str, dict] = {
    "eagle1": dict(algorithm="eagle1", num_eagle_layers=2),
    "eagle3": dict(algorithm="eagle3", num_eagle_layers=2, draft_vocab_size=48),
    "medusa": dict(algorithm="medusa", num_medusa_heads=3, num_medusa_layers=2),
    "peagle": dict(algorithm="peagle", num_eagle_layers=2, draft_vocab_size=48, parallel_depth=3, mask_token_id=5),
    "dflash": dict(algorithm="dflash", num_layers=2, block_size=4, target_layer_ids=[0, 2], mask_token_id=5),
}


def make_spec(cfg: ModelConfig, alg: str, seed: int = 0, perturb: bool = True):
    """A transformed tiny model; with ``perturb`` the draft weights are randomised (zero-init blocks made non-trivial)."""
    torch.manual_seed(seed)
    model = SpeculativeTransform(**ALG_KWARGS[alg])(build_gpt(cfg))
    return perturb_draft(model, seed + 1) if perturb else model


def train_draft(model, data: torch.Tensor, steps: int, lr: float = 3e-3, step_seed=None) -> List[dict]:
    """Adam over the draft's parameters only, ``steps`` steps of ``model.training_losses(data)``; returns each
    step's loss dict. ``step_seed``: ``torch.manual_seed(step_seed + i)`` before step i (sampled objectives)."""
    model.train()
    opt = torch.optim.Adam(list(model.draft_parameters()), lr=lr)
    outs = []
    for i in range(steps):
        if step_seed is not None:
            torch.manual_seed(step_seed + i)
        res = model.training_losses(data)
        opt.zero_grad()
        res["loss"].backward()
        opt.step()
        outs.append(res)
    return outs


def perturb_draft(model, seed: int, scale: float = 0.05):
    """Add seeded Gaussian noise (``scale``) to every draft parameter (zero-initialised blocks become non-trivial)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.draft_parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)
    return model


def expected_draft_params(cfg: ModelConfig, spec: SpeculativeConfig) -> int:
    """Independent count of draft parameter elements at TP=1."""
    h, f, v = cfg.hidden_size, cfg.ffn_hidden_size, cfg.vocab_size
    q = cfg.num_attention_heads * cfg.head_dim
    kv = 2 * cfg.num_query_groups * cfg.head_dim
    gated = cfg.activation == "swiglu"
    bias = cfg.add_bias_linear
    norm = h * (2 if cfg.normalization == "LayerNorm" else 1)

    def layer(in_qkv: int, input_norm: bool) -> int:
        n = in_qkv * (q + kv) + (q + kv if (bias or cfg.add_qkv_bias) else 0)
        n += q * h + (h if bias else 0)
        n += h * f * (2 if gated else 1) + (f * (2 if gated else 1) if bias else 0)
        n += f * h + (h if bias else 0)
        n += norm + (norm if input_norm else 0)
        return n

    if spec.algorithm == "medusa":
        return spec.num_medusa_heads * (spec.num_medusa_layers * (h * h + h) + v * h)
    if spec.algorithm == "eagle1":
        return 2 * h * h + h + layer(h, False) + (spec.num_eagle_layers - 1) * layer(h, True)
    vd = spec.draft_vocab_size or v
    return 3 * h * h + layer(2 * h, True) + norm + (spec.num_eagle_layers - 1) * layer(h, True) + norm + vd * h


def chain_logits(model, input_ids: torch.Tensor, t: int, steps: int) -> List[torch.Tensor]:
    """Chain drafting with the draft KV cache from row ``t``: step-i logits [b, Vd] (teacher-forced tokens)."""
    b = input_ids.shape[0]
    with torch.no_grad():
        out = model.base_forward(input_ids)
        feats = model.fuse(model.base_features(out))
        cache = model.new_draft_cache(b, t + steps + 1)
        n = t + 1
        pos = torch.arange(n)[None].expand(b, n)
        mask = (torch.arange(n)[None, :] <= torch.arange(n)[:, None])[None].expand(b, n, n)
        ctx = AttnContext(position_ids=pos, mask=mask, cache=cache, write_slots=pos, kv_len=n)
        hid, logits = model.draft_step(input_ids[:, 1: t + 2], feats[:, : t + 1], ctx)
        res = [logits[:, t]]
        h = hid[:, t: t + 1]
        for i in range(1, steps):
            p = t + i
            ctx = AttnContext(position_ids=torch.full((b, 1), p), mask=torch.ones(b, 1, p + 1, dtype=torch.bool),
                              cache=cache, write_slots=torch.full((b, 1), p), kv_len=p + 1)
            h, logits = model.draft_step(input_ids[:, t + 1 + i: t + 2 + i], h, ctx)
            res.append(logits[:, 0])
    return res
