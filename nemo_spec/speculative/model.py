"""SpeculativeGPT: a frozen megatron-core GPTModel plus a trainable draft (EAGLE-1/3, Medusa, P-EAGLE, DFlash)."""
from __future__ import annotations

import contextlib
import copy
import logging
from typing import Dict, Iterator, List, Optional, Tuple

import torch
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.module import MegatronModule
from nemo_spec._mcore import ensure_metadata

from nemo_spec import parallel
from nemo_spec.config import EAGLE3_LIKE, ModelConfig, SpeculativeConfig
from nemo_spec.models.attention import AttnContext, KVCache
from nemo_spec.models import foreign
from nemo_spec.models.gpt import GPTOutput, gpt_forward
from nemo_spec.speculative import losses
from nemo_spec.speculative.eagle import EagleDraft
from nemo_spec.speculative.medusa import MedusaHeads

log = logging.getLogger(__name__)

EAGLE_PREFIX = "eagle_module."
MEDUSA_PREFIX = "medusa_heads."


class SpeculativeGPT(MegatronModule):
    """Base GPTModel (``gpt``, frozen) + draft (``draft``: EagleDraft / PEagleDraft / DFlashDraft registered as
    ``eagle_module``, or MedusaHeads registered as ``medusa_heads``).

    State dict keys: ``gpt.<plain GPTModel key>`` and ``eagle_module.*`` / ``medusa_heads.*``. The distributed
    checkpoint (``sharded_state_dict``) stores the base under exactly the keys of a plain GPTModel checkpoint and
    the draft under ``eagle_module.`` / ``medusa_heads.``.
    """

    def __init__(self, gpt: GPTModel, spec_config: SpeculativeConfig, model_config: ModelConfig) -> None:
        super().__init__(config=gpt.config)
        self.gpt = gpt
        self.spec_config = spec_config
        self.model_config = model_config
        self.nemo_spec_config = model_config
        #: the optimizer step being trained, set by the training loop (our recipe, the NeMo callback); schedules
        #: of the draft objective read it (P-EAGLE ``depth_warmup_steps``)
        self.train_step: Optional[int] = None
        #: the longest sequence the draft was trained on (our recipe records it in the checkpoint; None: unknown).
        #: EAGLE generation lets the draft read at most this many prompt tokens by default (option
        #: ``draft_prompt_tokens``): a draft attends worse over contexts longer than it has seen.
        self.trained_seq_len: Optional[int] = None
        for p in self.gpt.parameters():
            p.requires_grad_(False)
        self.gpt.eval()
        if spec_config.algorithm == "medusa":
            self.medusa_heads = MedusaHeads(model_config, spec_config, gpt)
        elif spec_config.algorithm == "peagle":
            from nemo_spec.speculative.peagle import PEagleDraft

            self.eagle_module = PEagleDraft(model_config, spec_config, gpt)
        elif spec_config.algorithm == "dflash":
            from nemo_spec.speculative.dflash import DFlashDraft

            self.eagle_module = DFlashDraft(model_config, spec_config, gpt)
        else:
            self.eagle_module = EagleDraft(model_config, spec_config, gpt)
        if spec_config.algorithm in EAGLE3_LIKE:
            self._aux_layers = spec_config.resolved_aux_layers(model_config.num_layers)
        elif spec_config.algorithm == "dflash":  # the fused base layers (z-lab target_layer_ids, same numbering)
            self._aux_layers = list(self.eagle_module.target_layer_ids)
        else:
            self._aux_layers = []
        if parallel.tp_partial_grad_params(self) and not getattr(self.config, "qk_layernorm", False):
            # megatron-core's finalize_model_grads sums the q/k-norm gradients over TP only when the model
            # chunk's config says qk_layernorm (distributed/finalize_model_grads.py:353-356 at 0.16.1); the
            # draft's own q/k norms (DFlash) need that sum on a base without them, in a megatron loop that is
            # handed this model. A copy: the base's config object stays as it was. (NeMo reads its
            # LightningModule's config instead: integrations.nemo wraps its finalize_model_grads.)
            self.config = copy.copy(self.config)
            self.config.qk_layernorm = True
        log.info("speculative draft %s attached: %d trainable parameters (base frozen, %d parameters)",
                 spec_config.algorithm, self.num_draft_parameters(), sum(p.numel() for p in gpt.parameters()))

    # ---- structure ------------------------------------------------------------------------------------------
    @property
    def algorithm(self) -> str:
        """'eagle1', 'eagle3', 'peagle', 'dflash' or 'medusa'."""
        return self.spec_config.algorithm

    @property
    def draft(self):
        """The draft module (EagleDraft or MedusaHeads)."""
        return self.medusa_heads if self.algorithm == "medusa" else self.eagle_module

    @property
    def draft_prefix(self) -> str:
        """Checkpoint/state-dict prefix of the draft: 'eagle_module.' or 'medusa_heads.'."""
        return MEDUSA_PREFIX if self.algorithm == "medusa" else EAGLE_PREFIX

    @property
    def is_eagle(self) -> bool:
        """Whether the draft is an EAGLE head (drafting via draft_step: EAGLE-1, EAGLE-3, P-EAGLE)."""
        return self.algorithm in ("eagle1", "eagle3", "peagle")

    def draft_parameters(self) -> Iterator[torch.nn.Parameter]:
        """The trainable draft parameters (no base parameters)."""
        return self.draft.parameters()

    def num_draft_parameters(self) -> int:
        """Number of draft parameter elements on this TP rank."""
        return sum(p.numel() for p in self.draft_parameters())

    def train(self, mode: bool = True) -> "SpeculativeGPT":
        """Train/eval the draft; the frozen base always stays in eval mode."""
        super().train(mode)
        self.gpt.eval()
        return self

    # ---- base side ------------------------------------------------------------------------------------------
    @property
    def aux_layers(self) -> List[int]:
        """EAGLE-3: base layers (0-based) whose outputs feed the draft, in feature order; [] otherwise.

        Pass as ``gpt_forward(aux_layers=...)``; duplicates (shallow bases) are fine, base_features maps them.
        """
        return list(self._aux_layers)

    def base_forward(self, input_ids: torch.Tensor, ctx: Optional[AttnContext] = None, compute_logits: bool = True,
                     gather: bool = True) -> GPTOutput:
        """Base forward with the auxiliary layers this draft needs."""
        return gpt_forward(self.gpt, input_ids, ctx, aux_layers=self.aux_layers, compute_logits=compute_logits,
                           gather=gather)

    def base_features(self, out: GPTOutput) -> torch.Tensor:
        """Draft input features [b, s, F] from a base forward (EAGLE-3: cat of aux hiddens [b, s, 3h]; DFlash: of
        the target layers' hiddens [b, s, len(target_layer_ids) * h])."""
        if self.algorithm not in EAGLE3_LIKE + ("dflash",):
            return out.hidden
        uniq = sorted(set(self._aux_layers))
        if len(out.aux_hidden) != len(uniq):
            raise ValueError(f"base output has {len(out.aux_hidden)} auxiliary hidden states, expected {len(uniq)} "
                             f"(run gpt_forward with aux_layers={self._aux_layers})")
        by_layer = dict(zip(uniq, out.aux_hidden))
        return torch.cat([by_layer[i] for i in self._aux_layers], dim=-1)

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """Fused feature [b, s, h]: EAGLE-3 fc(3h -> h); DFlash hidden_norm(fc(.)); identity for EAGLE-1 / Medusa."""
        if self.algorithm == "dflash":
            return self.eagle_module.fuse(features)
        if self.algorithm not in EAGLE3_LIKE:
            return features
        return self.eagle_module.fuse(features)

    # ---- draft side -----------------------------------------------------------------------------------------
    def draft_step(self, input_ids: torch.Tensor, hidden: torch.Tensor, ctx: Optional[AttnContext] = None,
                   gather: bool = True, head: bool = True) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """One EAGLE pass: row t pairs feature f_t with token x_{t+1}; returns (out_hidden [b,s,h], logits [b,s,Vd])
        (``head=False``: logits None; :meth:`draft_logits` gives them for the rows that need them)."""
        if not self.is_eagle:
            raise TypeError(f"draft_step is for EAGLE drafts, this model's draft is {self.algorithm}")
        return self.eagle_module(self.gpt, input_ids, hidden, ctx, gather=gather, head=head)

    def draft_logits(self, out_hidden: torch.Tensor) -> torch.Tensor:
        """Draft logits [..., Vd] (gathered) of draft output hidden rows [..., h] from :meth:`draft_step`."""
        return self.eagle_module.logits(self.gpt, out_hidden)

    def medusa_logits(self, hidden: torch.Tensor, gather: bool = True) -> torch.Tensor:
        """Medusa logits [K, b, s, V] for base final hidden [b, s, h]; head k at t predicts x_{t+k+2}."""
        if self.algorithm != "medusa":
            raise TypeError(f"medusa_logits needs a Medusa draft, this model's draft is {self.algorithm}")
        return self.medusa_heads(hidden, gather=gather)

    @property
    def draft_vocab_size(self) -> int:
        """Size Vd of the draft's output vocabulary (base vocab unless EAGLE-3 with a reduced vocab)."""
        return self.eagle_module.draft_vocab_size if self.algorithm in EAGLE3_LIKE else self.model_config.vocab_size

    @property
    def d2t(self) -> torch.Tensor:
        """Offsets [Vd] with base_id = draft_id + d2t[draft_id] (zeros unless EAGLE-3 with a reduced vocab)."""
        if self.algorithm in EAGLE3_LIKE:
            return self.eagle_module.d2t
        dev = next(self.gpt.parameters()).device
        return torch.zeros(self.model_config.vocab_size, dtype=torch.long, device=dev)

    @property
    def t2d(self) -> torch.Tensor:
        """Bool [V]: base tokens present in the draft vocabulary."""
        return self.draft_vocab_mask()

    def draft_vocab_mask(self) -> torch.Tensor:
        """Bool [V]: base tokens present in the draft vocabulary."""
        if self.algorithm in EAGLE3_LIKE:
            return self.eagle_module.t2d
        dev = next(self.gpt.parameters()).device
        return torch.ones(self.model_config.vocab_size, dtype=torch.bool, device=dev)

    def draft_vocab_ids(self) -> torch.Tensor:
        """Base token id of each draft-vocab entry, LongTensor [Vd]."""
        d2t = self.d2t
        return torch.arange(d2t.numel(), device=d2t.device) + d2t

    def draft_to_base_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """Map draft-vocab token ids to base-vocab ids (identity unless EAGLE-3 with a reduced vocab)."""
        if self.algorithm not in EAGLE3_LIKE:
            return ids
        d2t = self.eagle_module.d2t
        return ids + d2t.to(ids.device)[ids]

    def set_draft_vocab(self, token_counts: torch.Tensor, reinit_head: bool = True) -> None:
        """EAGLE-3: choose the draft vocabulary as the most frequent tokens of ``token_counts`` [V] (call before training)."""
        if self.algorithm not in EAGLE3_LIKE:
            raise TypeError(f"set_draft_vocab needs an EAGLE-3 / P-EAGLE draft, this model's draft is {self.algorithm}")
        self.eagle_module.set_draft_vocab(token_counts, self.gpt, reinit_head=reinit_head)

    def new_draft_cache(self, batch_size: int, max_len: int, dtype: Optional[torch.dtype] = None) -> KVCache:
        """A KV cache for the draft's own decoder layers on this TP rank."""
        if not self.is_eagle and self.algorithm != "dflash":
            raise TypeError(f"a draft KV cache is for EAGLE / DFlash drafts, this model's draft is {self.algorithm}")
        cfg = self.model_config
        p = next(self.eagle_module.parameters())
        return KVCache(self.eagle_module.num_layers, batch_size, max_len, cfg.num_query_groups // parallel.tp_size(),
                       cfg.head_dim, dtype or p.dtype, p.device)

    # ---- training -------------------------------------------------------------------------------------------
    def training_losses(self, input_ids: torch.Tensor, loss_mask: Optional[torch.Tensor] = None,
                        base_out: Optional[GPTOutput] = None, decay: float = 0.8, ttt_steps: Optional[int] = None,
                        eagle1_ce_weight: float = 0.1, return_logits: bool = False,
                        token_loss: bool = False, generator: Optional[torch.Generator] = None) -> Dict[str, object]:
        """Draft losses for a batch: {"loss", "step_losses", "step_acc", (+ "base_logits", "step_logits")}.

        ``generator`` (CPU) draws the P-EAGLE COD samples / DFlash anchors (default: torch's global RNG); the
        training module seeds one per micro-batch from the run seed and the loop position, so a resumed run
        draws what the uninterrupted one drew, and every TP rank draws the same.

        ``loss_mask[b, p]`` marks tokens that are training targets (default: all). The base runs under no_grad
        unless ``base_out`` (offline mode: gathered logits, final hidden, aux hiddens for EAGLE-3) is given.
        ``token_loss`` adds "token_loss" [b, s]: the per-token loss by megatron label position (see losses).
        """
        if loss_mask is None:
            loss_mask = torch.ones_like(input_ids, dtype=torch.bool)
        if loss_mask.shape != input_ids.shape:
            raise ValueError(f"loss_mask shape {tuple(loss_mask.shape)} != input_ids shape {tuple(input_ids.shape)}")
        # EAGLE-3 needs the base logits only row block by row block (eagle3_targets computes them from the
        # final hidden states), so the [b, s, V] tensor is not built for it
        # DFlash rollouts continue the sequence in a KV cache: the online base forward's keys/values fill it
        seq_kv = {} if (base_out is None and self.algorithm == "dflash"
                        and self.spec_config.dflash_targets == "rollout") else None
        out = base_out if base_out is not None else losses.base_outputs(
            self, input_ids, compute_logits=self._base_logits_needed(), capture_kv=seq_kv)
        if self.algorithm == "eagle1":
            return losses.eagle1_losses(self, input_ids, loss_mask, out, ce_weight=eagle1_ce_weight,
                                        return_logits=return_logits, token_loss=token_loss)
        if self.algorithm == "peagle":
            from nemo_spec.speculative.peagle import peagle_losses

            return peagle_losses(self, input_ids, loss_mask, out, generator=generator, return_logits=return_logits,
                                 token_loss=token_loss)
        if self.algorithm == "dflash":
            from nemo_spec.speculative.dflash import dflash_losses

            return dflash_losses(self, input_ids, loss_mask, out, generator=generator, return_logits=return_logits,
                                 token_loss=token_loss, seq_kv=seq_kv)
        if self.algorithm == "eagle3":
            return losses.eagle3_losses(self, input_ids, loss_mask, out, ttt_steps or self.spec_config.ttt_steps,
                                        decay=decay, return_logits=return_logits, token_loss=token_loss)
        return losses.medusa_losses(self, input_ids, loss_mask, out, decay=decay, return_logits=return_logits,
                                    token_loss=token_loss)

    def _base_logits_needed(self) -> bool:
        if self.algorithm == "dflash":  # hard labels; the base's argmax is taken from the hidden states in row blocks
            return False
        return self.algorithm not in EAGLE3_LIKE or losses.REFERENCE_FORMULATION

    def forward(self, input_ids: torch.Tensor, position_ids: Optional[torch.Tensor] = None,
                attention_mask: Optional[torch.Tensor] = None, decoder_input: Optional[torch.Tensor] = None,
                labels: Optional[torch.Tensor] = None, inference_context: object = None,
                packed_seq_params: object = None, *, loss_mask: Optional[torch.Tensor] = None,
                base_out: Optional[GPTOutput] = None, **kwargs) -> object:
        """megatron GPTModel's signature (what NeMo's ``llm.GPTModel`` and megatron schedules call).

        With ``labels`` (training through NeMo / megatron): the per-token draft loss [b, s] in fp32 by label
        position, as GPTModel returns its per-token LM loss, for the caller's masked token mean (the labels'
        values are not used: the draft's targets are the base's own predictions). The base runs under no_grad
        through its own forward with the given ``position_ids`` / ``attention_mask``. Without ``labels``: the
        dict of :meth:`training_losses` (``loss_mask``, ``base_out`` and its keyword options).
        """
        if decoder_input is not None:
            raise ValueError("SpeculativeGPT does not take decoder_input (pipeline parallelism is not supported: "
                             "run the draft with the whole base on one pipeline stage)")
        if inference_context is not None:
            raise ValueError("SpeculativeGPT.forward is for training; generate with nemo_spec.inference")
        if packed_seq_params is not None:
            raise ValueError("SpeculativeGPT does not support packed sequences (packed_seq_params); train the draft "
                             "on unpacked batches")
        if base_out is None and (position_ids is not None or attention_mask is not None) \
                and not foreign.is_project_spec(self.gpt):
            with torch.no_grad():
                base_out = foreign.foreign_forward(self.gpt, input_ids, self.aux_layers,
                                                   compute_logits=self._base_logits_needed(),
                                                   position_ids=position_ids,
                                                   attention_mask=attention_mask if attention_mask is not None
                                                   else "causal")
        if labels is None:
            return self.training_losses(input_ids, loss_mask, base_out, **kwargs)
        if labels.shape != input_ids.shape:
            raise ValueError(f"labels shape {tuple(labels.shape)} != input_ids shape {tuple(input_ids.shape)}")
        res = self.training_losses(input_ids, loss_mask, base_out, token_loss=True, **kwargs)
        self.last_losses = {k: v for k, v in res.items() if k in ("step_losses", "step_acc")}
        return res["token_loss"]

    # ---- megatron / NeMo plumbing ---------------------------------------------------------------------------
    @property
    def model_type(self):
        """The base's megatron ``ModelType`` (megatron schedules look it up on the wrapped model)."""
        return self.gpt.model_type

    def set_input_tensor(self, input_tensor) -> None:
        """Pipeline input hand-off (megatron schedules call it every step): delegated to the base."""
        self.gpt.set_input_tensor(input_tensor)

    # ---- checkpointing --------------------------------------------------------------------------------------
    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: Optional[dict] = None):
        """Base under plain-GPTModel checkpoint keys, draft under 'eagle_module.' / 'medusa_heads.'.

        Dict keys follow ``state_dict()`` (``gpt.*``) so that ``load_state_dict`` accepts what
        ``dist_checkpointing.load`` returns.
        """
        metadata = ensure_metadata(metadata)
        base = self.gpt.sharded_state_dict(prefix=prefix, sharded_offsets=sharded_offsets, metadata=metadata)
        out = {f"{prefix}gpt.{k[len(prefix):]}": v for k, v in base.items()}
        name = self.draft_prefix
        if name[:-1] in self._modules:  # absent inside base_only()
            out.update(self.draft.sharded_state_dict(prefix=f"{prefix}{name}", sharded_offsets=sharded_offsets,
                                                     metadata=metadata))
        return out

    @contextlib.contextmanager
    def base_only(self) -> Iterator[None]:
        """Inside, the draft is set aside: ``state_dict``, ``sharded_state_dict`` and ``load_state_dict`` (strict)
        see the base alone, so a checkpoint of the base (a pretrained or imported one, without any draft) restores
        into the transformed model; the draft's parameters stay the same objects (an optimizer or DDP holding them
        is unaffected)."""
        name = self.draft_prefix[:-1]
        draft = self._modules.pop(name)
        try:
            yield
        finally:
            self._modules[name] = draft
