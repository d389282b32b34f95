"""P-EAGLE (parallel EAGLE) draft: an EAGLE-3 head that drafts K tokens in ONE forward.

References: vllm-project/speculators ``src/speculators/models/peagle/{core,data,attention}.py`` (training) and
vLLM 0.33.0 (serving: ``v1/spec_decode/llm_base_proposer.py`` parallel drafting, ``v1/spec_decode/utils.py``
``copy_and_expand_eagle_inputs_kernel``, ``model_executor/models/llama_eagle3.py``).

The module is :class:`EagleDraft` in its EAGLE-3 shape (same megatron layer specs, fc, first layer over
cat(norm(embed), hidden_norm(feature)), final norm, vocab-parallel lm_head, d2t) plus two inputs for the
positions after the first of a drafted block:

    mask_hidden [1, 1, 3h]   learned stand-in for the three aux base features (before ``fc``); vLLM feeds
                             ``fc(mask_hidden)`` (llm_base_proposer.py:1404-1416)
    mask_embed  [h]          learned embedding of ``mask_token_id`` (the draft's own embedding row: exported as
                             ``embed_tokens`` = base embedding with that row replaced; vLLM keeps a draft's
                             distinct embed_tokens, llm_base_proposer.py:1438-1466). Every occurrence of
                             ``mask_token_id`` is embedded with it, exactly as the exported table does.

Drafting (vLLM's layout, utils.py:490-536): after the accepted pairs (f_t, x_{t+1}) of EAGLE, whose last pair
holds the bonus token, come K-1 slots of (fc(mask_hidden), mask_token_id) at positions anchor+1..anchor+K-1; one
causal forward; the bonus pair's output predicts draft token 1 and mask slot d predicts draft token d+1.

Training (:func:`peagle_losses`): depth 0 is EAGLE's pair row t (predicts x_{t+2}); the depth-d element of the
chain anchored at t is a mask slot at position t+d predicting x_{t+2+d}. COD sampling (:func:`cod_sample`)
keeps all depth-0 rows and, per depth, a random subset of the surviving chains; all elements are flattened into
one sequence with the mask of :func:`peagle_attention_mask`.
"""
from __future__ import annotations

import logging
from typing import Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F

from nemo_spec.config import ModelConfig, SpeculativeConfig
from nemo_spec.models.attention import AttnContext
from nemo_spec.speculative.eagle import EagleDraft, _gather_rows, _replicated_buffer

log = logging.getLogger(__name__)


class PEagleDraft(EagleDraft):
    """EAGLE-3 draft head with P-EAGLE's learned mask inputs (``mask_hidden``, ``mask_embed``)."""

    def __init__(self, model_config: ModelConfig, spec_config: SpeculativeConfig, base: torch.nn.Module) -> None:
        if spec_config.algorithm != "peagle":
            raise ValueError(f"PEagleDraft needs algorithm 'peagle', got {spec_config.algorithm!r}")
        super().__init__(model_config, spec_config, base)
        p = next(base.parameters())
        self.mask_token_id = spec_config.resolved_mask_token_id(model_config)
        self.parallel_depth = spec_config.parallel_depth
        h = model_config.hidden_size
        gen = torch.Generator().manual_seed(1234 + self.mask_token_id)  # identical on every TP rank
        # speculators initialises mask_hidden with randn (peagle/core.py, PEagleDraftModel.__init__)
        self.mask_hidden = torch.nn.Parameter(torch.randn(1, 1, 3 * h, generator=gen).to(p.dtype).to(p.device))
        row = _gather_rows(base.embedding.word_embeddings.weight)[self.mask_token_id]
        self.mask_embed = torch.nn.Parameter(row.detach().clone().to(p.dtype).to(p.device))

    def embed(self, base: torch.nn.Module, input_ids: torch.Tensor, fast: bool = False) -> torch.Tensor:
        """Base token embeddings [s, b, h], with ``mask_embed`` wherever the token is ``mask_token_id``."""
        emb = super().embed(base, input_ids, fast)
        is_mask = (input_ids.t() == self.mask_token_id)[..., None]
        return torch.where(is_mask, self.mask_embed.to(emb.dtype), emb)

    def mask_feature(self) -> torch.Tensor:
        """The fused feature of a mask slot, fc(mask_hidden) [h]."""
        return self.fc(self.mask_hidden.to(self.fc.weight.dtype)).reshape(-1)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: Optional[dict] = None):
        """EAGLE-3's distributed-checkpoint view plus the replicated mask parameters."""
        out = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        out.update(_replicated_buffer(self.mask_hidden, f"{prefix}mask_hidden", metadata))
        out.update(_replicated_buffer(self.mask_embed, f"{prefix}mask_embed", metadata))
        return out


# ---- COD sampling and the flattened training sequence ---------------------------------------------------------

def cod_sample(valid: torch.Tensor, depths: int, ratio: float, ratio_min: float,
               generator: Optional[torch.Generator] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """COD sampling for one sequence: (anchor [N], depth [N]) of the kept elements, depth-major.

    ``valid[d, t]``: the depth-d element anchored at t has a training target. Depth 0 keeps every anchor
    (t in [0, s)); depth d >= 1 keeps ``int((n0 - d) * max(ratio^d, ratio_min))`` chains, n0 = number of valid
    depth-0 anchors, drawn uniformly from the chains kept at depth d-1 whose depth-d element is valid (all of
    them when fewer), so chains are nested (speculators peagle/data.py ``generate_cod_sample_indices``).
    """
    D, s = valid.shape
    dev = valid.device
    anchors = [torch.arange(s, device=dev)]
    n0 = int(valid[0].sum())
    alive = torch.nonzero(valid[0]).flatten()
    for d in range(1, D):
        pool = alive[valid[d, alive]]
        size = int(max(0, n0 - d) * max(ratio ** d, ratio_min))
        if size <= 0 or pool.numel() == 0:
            break
        if pool.numel() > size:
            pick = torch.randperm(pool.numel(), generator=generator)[:size].to(dev)
            pool = pool[pick].sort().values
        anchors.append(pool)
        alive = pool
    anchor = torch.cat(anchors)
    depth = torch.cat([torch.full((a.numel(),), d, dtype=torch.long, device=dev) for d, a in enumerate(anchors)])
    return anchor, depth


def peagle_attention_mask(anchor: torch.Tensor, depth: torch.Tensor, present: torch.Tensor) -> torch.Tensor:
    """Bool [b, N, N] (True = attend) over flattened elements [b, N]: a query sees the depth-0 elements at or
    before its anchor and its own chain's elements of lower or equal depth (speculators peagle/attention.py
    ``peagle_mask_mod``); padding elements (``present`` False) see only themselves."""
    qa, ka = anchor[:, :, None], anchor[:, None, :]
    qd, kd = depth[:, :, None], depth[:, None, :]
    ok = ((kd == 0) & (ka <= qa)) | ((ka == qa) & (kd <= qd))
    ok = ok & present[:, :, None] & present[:, None, :]
    eye = torch.eye(anchor.shape[1], dtype=torch.bool, device=anchor.device)[None]
    return ok | eye


def flatten_cod(loss_mask: torch.Tensor, depths: int, ratio: float, ratio_min: float,
                generator: Optional[torch.Generator] = None) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """COD-sample every row of a batch; (anchor [b, N], depth [b, N], present [b, N]) right-padded to one N.

    Element (t, d) predicts x_{t+2+d}: it is valid when t + 2 + d < s and ``loss_mask`` is set there.
    """
    b, s = loss_mask.shape
    dev = loss_mask.device
    rows = []
    for r in range(b):
        valid = torch.stack([F.pad(loss_mask[r, 2 + d:].bool(), (0, min(s, 2 + d))) if 2 + d < s
                             else torch.zeros(s, dtype=torch.bool, device=dev) for d in range(depths)])
        rows.append(cod_sample(valid, depths, ratio, ratio_min, generator))
    n = max(a.numel() for a, _ in rows)
    anchor = torch.zeros(b, n, dtype=torch.long, device=dev)
    depth = torch.zeros(b, n, dtype=torch.long, device=dev)
    present = torch.zeros(b, n, dtype=torch.bool, device=dev)
    for r, (a, d) in enumerate(rows):
        anchor[r, :a.numel()] = a
        depth[r, :a.numel()] = d
        present[r, :a.numel()] = True
    return anchor, depth, present


def peagle_losses(model, input_ids: torch.Tensor, loss_mask: torch.Tensor, out, depths: Optional[int] = None,
                  ratio: Optional[float] = None, ratio_min: Optional[float] = None,
                  generator: Optional[torch.Generator] = None, return_logits: bool = False,
                  token_loss: bool = False) -> Dict[str, object]:
    """P-EAGLE loss: KL(base || draft) over the draft vocabulary, summed over all COD-sampled elements with a
    target (in the draft vocabulary, ``loss_mask`` set) and divided by their number.

    ``depths`` (default ``parallel_depth``): with ``spec.depth_warmup_steps`` = N, a model in training mode whose
    ``train_step`` (the optimizer step, set by the training loop) is below N trains depth 0 only — EAGLE-3's
    first step, whose accuracy otherwise stalls under the deeper elements' gradients at small budgets.

    Returns {"loss", "step_losses" (per depth), "step_acc" (per depth), (+ "token_loss" [b, s] by megatron
    label position t + 1 + d, unnormalised)}.
    """
    from nemo_spec.speculative.losses import eagle3_targets, soft_cross_entropy_rows

    sc = model.spec_config
    if depths is None:  # depth warm-up: the recipe / NeMo callback set the optimizer step being trained
        step = getattr(model, "train_step", None)
        warm = model.training and step is not None and step < int(sc.depth_warmup_steps or 0)
        depths = 1 if warm else sc.parallel_depth
    ratio = sc.cod_ratio if ratio is None else ratio
    ratio_min = sc.cod_ratio_min if ratio_min is None else ratio_min
    draft: PEagleDraft = model.eagle_module
    b, s = input_ids.shape
    dev = input_ids.device
    feats = model.fuse(model.base_features(out))  # [b, s, h]
    probs, top, in_vocab = eagle3_targets(model, out)  # [s, b, Vd], [s, b], [s, b] | None
    anchor, depth, present = flatten_cod(loss_mask, depths, ratio, ratio_min, generator)
    n = anchor.shape[1]
    rows = torch.arange(b, device=dev)[:, None]
    is0 = depth == 0
    tok_pos = (anchor + 1).clamp(max=s - 1)
    tokens = torch.where(is0, input_ids[rows, tok_pos], torch.full_like(anchor, draft.mask_token_id))
    tokens = torch.where(is0 & (anchor + 1 >= s), torch.zeros_like(tokens), tokens)
    feat = torch.where(is0[..., None], feats[rows, anchor], draft.mask_feature().to(feats.dtype)[None, None])
    ctx = AttnContext(position_ids=anchor + depth, mask=peagle_attention_mask(anchor, depth, present))
    _, logits = model.draft_step(tokens, feat, ctx)  # [b, n, Vd]
    tgt = (anchor + 1 + depth).clamp(max=s - 1)  # base row predicting x_{t+2+d}
    lab = anchor + 2 + depth
    has = present & (lab < s)
    has = has & loss_mask.bool()[rows, lab.clamp(max=s - 1)]
    if in_vocab is not None:
        has = has & in_vocab.t()[rows, tgt]
    target = probs.transpose(0, 1)[rows, tgt]  # [b, n, Vd]
    vd = target.shape[-1]
    ce, pred = soft_cross_entropy_rows(logits.reshape(b * n, vd), target.reshape(b * n, vd))
    with torch.no_grad():
        ent = -(target * torch.log(target.clamp(min=1e-30))).sum(-1).reshape(b * n)
    kl = (ce - ent).view(b, n)
    w = has.float()
    loss = (kl * w).sum() / w.sum().clamp(min=1.0)
    step_losses, step_acc = [], []
    with torch.no_grad():
        correct = (pred.view(b, n) == top.t()[rows, tgt]).float()
        for d in range(depths):
            m = w * (depth == d).float()
            den = m.sum().clamp(min=1.0)
            step_losses.append((kl.detach() * m).sum() / den)
            step_acc.append((correct * m).sum() / den)
    res: Dict[str, object] = {"loss": loss, "step_losses": step_losses, "step_acc": step_acc,
                              "num_elements": int(present.sum())}
    if token_loss:
        tok = torch.zeros(b, s, dtype=torch.float32, device=dev)
        lp = (anchor + 1 + depth).clamp(max=s - 1)
        tok.index_put_((rows.expand(b, n), lp), (kl * w).float(), accumulate=True)
        res["token_loss"] = tok
    if return_logits:
        res.update(step_logits=[logits], anchor=anchor, depth=depth, present=present)
    return res


def cod_element_counts(n0: int, depths: int, ratio: float, ratio_min: float) -> List[int]:
    """Expected elements per depth for ``n0`` valid anchors (sizing: the flattened length is their sum)."""
    return [n0] + [int(max(0, n0 - d) * max(ratio ** d, ratio_min)) for d in range(1, depths)]
