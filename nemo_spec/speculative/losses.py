"""Draft training losses: EAGLE-1 (feature regression + CE), EAGLE-3 training-time test, Medusa per-head CE.

Alignment conventions (all tensors [b, s, ...], ``loss_mask[b, p] = 1`` when token ``p`` is a training target):

* base logits at position p predict x_{p+1}; base feature f_p is the base hidden state at p;
* an EAGLE row t pairs (f_t, x_{t+1}) and predicts x_{t+2} (and, for EAGLE-1, the feature f_{t+1});
* EAGLE-3 unrolled step i, row t pairs (step i-1 output at t, x_{t+1+i}) and predicts x_{t+2+i};
* Medusa head k at position t predicts x_{t+k+2}.

A row counts only when its predicted token exists (index < s) and ``loss_mask`` is set there.
Logits arrive gathered over the vocabulary (the gather's backward hands each TP rank its own slice),
so the losses are identical on every TP rank and correct for vocab-parallel output layers.
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F

from nemo_spec.models.attention import AttnContext
from nemo_spec.models.gpt import GPTOutput, gather_vocab, gpt_forward, model_config, output_logits
from nemo_spec.speculative.eagle import TTTContext, ttt_mask


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``values`` over positions where ``mask`` is set (0 when nothing is set)."""
    mask = mask.to(values.dtype)
    return (values * mask).sum() / mask.sum().clamp(min=1.0)


def _row_block(vocab: int, device: torch.device) -> int:
    """Rows per block for row-wise vocabulary passes: ~4 MiB of fp32 on CPU (temporaries stay small and are reused
    instead of full [rows, V] buffers); everything in one block on GPU."""
    if device.type != "cpu":
        return 1 << 40
    return max(1, (1 << 20) // max(1, vocab))


class _SoftCrossEntropyRows(torch.autograd.Function):
    """Rows 0..N-1 of ``logits`` [R, V] (R >= N): -sum_v p log_softmax(z) against ``target_probs`` [N, V] in fp32,
    plus each row's argmax (not differentiable). Rows N.. get a zero gradient.

    Row-blocked, so no full-size temporary is made in either direction: the backward writes the gradient
    (softmax(z) * sum_v p - p) * g, the expression autograd derives for the composite, straight into its output.
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, target_probs: torch.Tensor):  # type: ignore[override]
        n, v = target_probs.shape
        ce = torch.empty(n, dtype=torch.float32, device=logits.device)
        top = torch.empty(n, dtype=torch.long, device=logits.device)
        step = _row_block(v, logits.device)
        for a in range(0, n, step):
            e = min(a + step, n)
            z = logits[a:e].float()
            ce[a:e] = -(target_probs[a:e].float() * F.log_softmax(z, dim=-1)).sum(-1)
            top[a:e] = z.argmax(-1)
        ctx.save_for_backward(logits, target_probs)
        ctx.mark_non_differentiable(top)
        return ce, top

    @staticmethod
    def backward(ctx, grad_ce: torch.Tensor, _grad_top: torch.Tensor):  # type: ignore[override]
        logits, target_probs = ctx.saved_tensors
        n, v = target_probs.shape
        out = torch.empty_like(logits)
        out[n:].zero_()
        step = _row_block(v, logits.device)
        for a in range(0, n, step):
            e = min(a + step, n)
            g = grad_ce[a:e, None].float()
            p = target_probs[a:e].float()
            grad = torch.softmax(logits[a:e].float(), dim=-1)
            out[a:e] = grad.mul_(p.sum(-1, keepdim=True) * g).addcmul_(p, g, value=-1.0)
        return out, None


def soft_cross_entropy_rows(logits: torch.Tensor, target_probs: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(cross-entropy [N] in fp32, argmax [N]) of the first N = len(target_probs) rows of ``logits`` [R, V]."""
    if target_probs.shape[0] > logits.shape[0] or target_probs.shape[1:] != logits.shape[1:]:
        raise ValueError(f"target_probs {tuple(target_probs.shape)} does not fit logits {tuple(logits.shape)}")
    return _SoftCrossEntropyRows.apply(logits, target_probs.detach())


def soft_cross_entropy(logits: torch.Tensor, target_probs: torch.Tensor) -> torch.Tensor:
    """Per-position cross-entropy -sum p log softmax(logits), in fp32 (no gradient to the targets)."""
    v = logits.shape[-1]
    ce, _ = soft_cross_entropy_rows(logits.reshape(-1, v), target_probs.reshape(-1, v))
    return ce.view(logits.shape[:-1])


def shifted_mask(loss_mask: torch.Tensor, shift: int) -> torch.Tensor:
    """Row t -> loss_mask[t + shift] (False where t + shift >= s)."""
    b, s = loss_mask.shape
    out = torch.zeros_like(loss_mask, dtype=torch.bool)
    if shift < s:
        out[:, : s - shift] = loss_mask[:, shift:].bool()
    return out


def shift_left(x: torch.Tensor, shift: int, fill: int = 0) -> torch.Tensor:
    """Row t -> x[t + shift] along dim 1 (``fill`` past the end)."""
    if shift == 0:
        return x
    out = torch.full_like(x, fill)
    if shift < x.shape[1]:
        out[:, : x.shape[1] - shift] = x[:, shift:]
    return out


#: True: the straightforward quadratic-memory formulation (explicit [s, s * steps] TTT masks, full base logits
#: for every position) that the memory-linear one is tested and benchmarked against; never needed otherwise
REFERENCE_FORMULATION = False


def base_outputs(model, input_ids: torch.Tensor, compute_logits: bool = True,
                 capture_kv: Optional[Dict[int, Tuple[torch.Tensor, torch.Tensor]]] = None) -> GPTOutput:
    """Frozen base forward (no grad, causal attention without an explicit mask) with the auxiliary layers the
    draft needs and, with ``compute_logits``, gathered full-vocabulary logits for every position. ``capture_kv``
    (a dict) receives each layer's rotated keys/values (see ``AttnContext.capture_kv``; empty for a base of
    another layer spec, whose forward is its own)."""
    ctx = None
    if capture_kv is not None:
        b, s = input_ids.shape
        ctx = AttnContext(position_ids=torch.arange(s, device=input_ids.device)[None].expand(b, s),
                          capture_kv=capture_kv)
    with torch.no_grad():
        return gpt_forward(model.gpt, input_ids, ctx, aux_layers=model.aux_layers, compute_logits=compute_logits,
                           gather=True)


def _base_logit_rows(model, out: GPTOutput) -> Tuple[Callable[[int, int], torch.Tensor], int, int]:
    """(rows(a, z) -> gathered base logits of [s, b]-ordered rows a..z, number of rows, vocab size): from
    ``out.logits`` when they exist, else computed from the final hidden states one row block at a time, so the
    full-vocabulary logits never exist for the whole sequence at once."""
    if out.logits is not None:
        logits = out.logits.detach().transpose(0, 1)  # [s, b, V]: gpt_forward's own memory layout
        rows = logits.reshape(-1, logits.shape[-1])
        return (lambda a, z: rows[a:z]), rows.shape[0], rows.shape[1]
    hidden = out.hidden.detach().transpose(0, 1)
    hid = hidden.reshape(-1, 1, hidden.shape[-1])
    vocab = model_config(model.gpt).vocab_size

    def rows_from_hidden(a: int, z: int) -> torch.Tensor:
        with torch.no_grad():
            return gather_vocab(output_logits(model.gpt, hid[a:z]))[:, 0]

    return rows_from_hidden, hid.shape[0], vocab


def _softmax_rows(rows: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(softmax in fp32, argmax) of logits rows [R, V], computed in row blocks (one read, no full-size temporary)."""
    r, v = rows.shape
    probs = torch.empty(r, v, dtype=torch.float32, device=rows.device)
    top = torch.empty(r, dtype=torch.long, device=rows.device)
    step = _row_block(v, rows.device)
    for a in range(0, r, step):
        z = rows[a:a + step]
        probs[a:a + step] = F.softmax(z.float(), -1)
        top[a:a + step] = z.argmax(-1)
    return probs, top


def add_token_losses(tok: Optional[torch.Tensor], rows: torch.Tensor, mask: torch.Tensor, offset: int,
                     weight: float = 1.0) -> None:
    """Add ``weight * rows * mask`` ([n, b], row t) into the per-token loss ``tok`` [b, s] at position t + offset:
    megatron's label position, whose label is the token the row predicts (label p = token p + 1)."""
    if tok is None:
        return
    n = min(rows.shape[0], tok.shape[1] - offset)
    if n > 0:
        tok[:, offset:offset + n] += weight * (rows[:n].float() * mask[:n].to(torch.float32)).t()


def eagle1_losses(model, input_ids: torch.Tensor, loss_mask: torch.Tensor, out: GPTOutput,
                  ce_weight: float = 0.1, return_logits: bool = False,
                  token_loss: bool = False) -> Dict[str, object]:
    """EAGLE-1: SmoothL1(draft hidden, next base feature) + ce_weight * soft CE through the frozen head.

    Row t (t < s - 2, ``loss_mask`` at t + 2 set) is scored against the base at t + 1; the vocabulary-sized part
    works on row ranges of the [s, b] tensors the models produce. ``token_loss``: also the unnormalised per-token
    loss [b, s] by megatron label position (row t at t + 1), which a masked token mean reduces.
    """
    b, s = input_ids.shape
    feats = out.hidden.detach()
    base_logits = out.logits.detach()
    tokens = shift_left(input_ids, 1)
    hid, logits = model.draft_step(tokens, feats)
    mask = shifted_mask(loss_mask, 2)
    reg = F.smooth_l1_loss(hid.float(), shift_left(feats, 1).float(), reduction="none").mean(-1)
    reg_l = masked_mean(reg, mask)
    n, v = max(0, s - 2), logits.shape[-1]
    probs, top = _softmax_rows(base_logits.transpose(0, 1)[1:1 + n].reshape(n * b, v))
    ce, pred = soft_cross_entropy_rows(logits.transpose(0, 1).reshape(s * b, v), probs)
    mask_sb = loss_mask.bool().t()[2:2 + n]
    ce_l = masked_mean(ce.view(n, b), mask_sb)
    loss = reg_l + ce_weight * ce_l
    with torch.no_grad():
        acc = masked_mean((pred.view(n, b) == top.view(n, b)).float(), mask_sb)
    res: Dict[str, object] = {"loss": loss, "step_losses": [loss.detach()], "step_acc": [acc],
                              "reg_loss": reg_l.detach(), "ce_loss": ce_l.detach()}
    if token_loss:
        tok = torch.zeros(b, s, dtype=torch.float32, device=input_ids.device)
        add_token_losses(tok, reg.t()[:n], mask.t()[:n], 1)
        add_token_losses(tok, ce.view(n, b), mask_sb, 1, ce_weight)
        res["token_loss"] = tok
    if return_logits:
        res.update(base_logits=base_logits, step_logits=[logits])
    return res


def eagle3_targets(model, out: GPTOutput) -> Tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """EAGLE-3 targets in [s, b] row order: the base's distribution over the draft vocabulary [s, b, Vd] (fp32), its
    argmax [s, b] (draft ids), and whether the base's top token over the full vocabulary is in the draft vocabulary
    [s, b] (None when the draft vocabulary is the whole base vocabulary in base order: always)."""
    b, s = out.hidden.shape[:2]
    dev = out.hidden.device
    rows, n_rows, v = _base_logit_rows(model, out)
    ids = model.draft_vocab_ids().to(dev)
    identity = ids.numel() == v and not bool(model.d2t.any())
    t2d = None if identity else model.draft_vocab_mask().to(dev)
    probs = torch.empty(s * b, ids.numel(), dtype=torch.float32, device=dev)
    top = torch.empty(s * b, dtype=torch.long, device=dev)
    in_vocab = None if identity else torch.empty(s * b, dtype=torch.bool, device=dev)
    step = _row_block(v, dev)
    for a in range(0, s * b, step):  # row blocks: one read (or one computation) of the base logits
        z = rows(a, a + step)
        if not identity:
            in_vocab[a:a + step] = t2d[z.argmax(-1)]
            z = z.index_select(-1, ids)
        probs[a:a + step] = F.softmax(z.float(), -1)
        top[a:a + step] = probs[a:a + step].argmax(-1)
    return (probs.view(s, b, -1), top.view(s, b), None if in_vocab is None else in_vocab.view(s, b))


def _head_ce_block(head: torch.nn.Module, x: torch.Tensor, targets: torch.Tensor):
    return soft_cross_entropy_rows(head.head_logits(x[:, None])[:, 0], targets)


def _chunked_head_ce(head: torch.nn.Module, x: torch.Tensor,
                     targets: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(soft CE [N], argmax [N]) of the draft head on hidden rows ``x`` [R >= N, h] against ``targets`` [N, Vd],
    one checkpointed row block at a time (each block's logits are recomputed in the backward pass)."""
    from torch.utils.checkpoint import checkpoint

    n, v = targets.shape
    if n == 0:
        return soft_cross_entropy_rows(head.head_logits(x[:1, None])[:, 0], targets)
    step = max(1, 4 * _row_block(v, x.device))
    ces, preds = [], []
    for a in range(0, n, step):
        e = min(a + step, n)
        ce, pred = checkpoint(_head_ce_block, head, x[a:e], targets[a:e], use_reentrant=False)
        ces.append(ce)
        preds.append(pred)
    return torch.cat(ces), torch.cat(preds)


#: EAGLE-3 training (memory-linear path): recompute each unrolled draft step in the backward pass instead of
#: keeping its activations (each step's layer saves ~20 [s, h]-sized tensors; the recomputation is one more
#: forward of the draft layers, small next to the base's forward)
CHECKPOINT_TTT_STEPS = True


def _fuse_block(model, *aux: torch.Tensor) -> torch.Tensor:
    return model.fuse(torch.cat(aux, dim=-1))


def _fused_features(model, out: GPTOutput) -> torch.Tensor:
    """EAGLE-3 fused feature fc(cat(aux hiddens)) [b, s, h]; with autograd recording, the [b, s, 3h] concatenation
    is recomputed in the backward pass instead of being kept for the fc's weight gradient."""
    uniq = sorted(set(model.aux_layers))
    if not (CHECKPOINT_TTT_STEPS and torch.is_grad_enabled()) or len(out.aux_hidden) != len(uniq):
        return model.fuse(model.base_features(out))  # (base_features raises on a wrong number of aux hiddens)
    from torch.utils.checkpoint import checkpoint

    by_layer = dict(zip(uniq, (a.detach() for a in out.aux_hidden)))
    return checkpoint(_fuse_block, model, *[by_layer[i] for i in model.aux_layers], use_reentrant=False)


def _ttt_step_block(model, tokens: torch.Tensor, hidden: torch.Tensor, ctx: TTTContext,
                    earlier: Dict[int, List[Tuple[torch.Tensor, torch.Tensor]]]):
    """One unrolled draft step on a private copy of the earlier steps' keys/values: (hidden, its new keys/values)."""
    import dataclasses

    own = dataclasses.replace(ctx, store={k: list(v) for k, v in earlier.items()}, rope_cache={})
    out, _ = model.draft_step(tokens, hidden, own, head=False)
    return out, {k: v[len(earlier.get(k, ())):] for k, v in own.store.items()}


def _ttt_draft_step(model, tokens: torch.Tensor, hidden: torch.Tensor, ctx: TTTContext) -> torch.Tensor:
    """Draft hidden states of one training-time-test step (its keys/values appended to ``ctx.store``); with
    autograd recording and :data:`CHECKPOINT_TTT_STEPS`, checkpointed: only its inputs and the new keys/values
    (which later steps attend to) stay alive until the backward pass recomputes it."""
    if not (CHECKPOINT_TTT_STEPS and torch.is_grad_enabled()):
        out, _ = model.draft_step(tokens, hidden, ctx, head=False)
        return out
    import dataclasses

    from torch.utils.checkpoint import checkpoint

    frozen = dataclasses.replace(ctx, store={}, rope_cache={})  # this step's positions, for the recomputation
    earlier = {k: list(v) for k, v in ctx.store.items()}
    out, new = checkpoint(_ttt_step_block, model, tokens, hidden, frozen, earlier, use_reentrant=False)
    for k, v in new.items():
        ctx.store.setdefault(k, []).extend(v)
    return out


def eagle3_losses(model, input_ids: torch.Tensor, loss_mask: torch.Tensor, out: GPTOutput,
                  ttt_steps: int, decay: float = 0.8, return_logits: bool = False,
                  token_loss: bool = False) -> Dict[str, object]:
    """EAGLE-3 training-time test: ``ttt_steps`` unrolled steps, soft CE vs the base restricted to the draft vocab.

    Step i, row t (t < s - 2 - i) is scored against the base distribution at t + 1 + i where ``loss_mask`` at
    t + 2 + i is set and the base's top token there is in the draft vocabulary. Work happens in the [s, b] row
    order the models produce, on row ranges (no shifted copies; rows past the end are not scored).
    ``token_loss``: also the per-token loss [b, s] (sum over steps of decay^i * CE, step i row t at label position
    t + 1 + i), which a masked token mean reduces.
    """
    b, s = input_ids.shape
    linear = not (return_logits or REFERENCE_FORMULATION)
    feats = _fused_features(model, out) if linear else model.fuse(model.base_features(out))
    probs, top, in_vocab = eagle3_targets(model, out)
    vd = probs.shape[-1]
    mask_sb = loss_mask.bool().t()
    ctx = TTTContext(position_ids=torch.arange(s, device=input_ids.device)[None].expand(b, s))
    hidden = feats
    total = torch.zeros((), device=input_ids.device)
    step_losses: List[torch.Tensor] = []
    step_acc: List[torch.Tensor] = []
    step_logits: List[torch.Tensor] = []
    tok = torch.zeros(b, s, dtype=torch.float32, device=input_ids.device) if token_loss else None
    for i in range(ttt_steps):
        ctx.position_ids = (torch.arange(s, device=input_ids.device) + i)[None].expand(b, s)
        if REFERENCE_FORMULATION:
            ctx.mask = ttt_mask(s, i, input_ids.device)[None].expand(b, s, s * (i + 1))
        # else ctx.mask stays None: the draft attends in the ttt_mask pattern without materialising it
        tokens = shift_left(input_ids, 1 + i)
        n = max(0, s - 2 - i)  # rows t whose predicted token t + 2 + i exists
        targets = probs[1 + i: 1 + i + n].reshape(n * b, vd)
        if return_logits or REFERENCE_FORMULATION:
            hidden, logits = model.draft_step(tokens, hidden, ctx)
            ce, pred = soft_cross_entropy_rows(logits.transpose(0, 1).reshape(s * b, vd), targets)
        else:  # the draft head and its loss in checkpointed row blocks: no [s, b, Vd] logits for the sequence
            hidden = _ttt_draft_step(model, tokens, hidden, ctx)
            ce, pred = _chunked_head_ce(model.eagle_module, hidden.transpose(0, 1).reshape(s * b, -1), targets)
        mask = mask_sb[2 + i: 2 + i + n]
        if in_vocab is not None:
            mask = mask & in_vocab[1 + i: 1 + i + n]
        loss_i = masked_mean(ce.view(n, b), mask)
        total = total + (decay ** i) * loss_i
        add_token_losses(tok, ce.view(n, b), mask, 1 + i, decay ** i)
        with torch.no_grad():
            step_acc.append(masked_mean((pred.view(n, b) == top[1 + i: 1 + i + n]).float(), mask))
        step_losses.append(loss_i.detach())
        if return_logits:
            step_logits.append(logits)
    res: Dict[str, object] = {"loss": total, "step_losses": step_losses, "step_acc": step_acc}
    if tok is not None:
        res["token_loss"] = tok
    if return_logits:
        base_logits = out.logits if out.logits is not None else (
            _base_logit_rows(model, out)[0](0, s * b).view(s, b, -1).transpose(0, 1))
        res.update(base_logits=base_logits.detach(), step_logits=step_logits)
    return res


def vocab_parallel_argmax(local_logits: torch.Tensor) -> torch.Tensor:
    """Argmax over the full vocabulary of vocab-parallel logits [..., V/tp] (global token ids)."""
    from nemo_spec import parallel

    with torch.no_grad():
        vals, idx = local_logits.max(-1)
        tp = parallel.tp_size()
        if tp == 1:
            return idx
        import torch.distributed as dist
        from megatron.core import parallel_state

        idx = idx + parallel.tp_rank() * local_logits.shape[-1]
        group = parallel_state.get_tensor_model_parallel_group()
        all_vals = [torch.empty_like(vals) for _ in range(tp)]
        all_idx = [torch.empty_like(idx) for _ in range(tp)]
        dist.all_gather(all_vals, vals.contiguous(), group=group)
        dist.all_gather(all_idx, idx.contiguous(), group=group)
        best = torch.stack(all_vals).argmax(0, keepdim=True)  # first max -> lowest id, as a full argmax
        return torch.stack(all_idx).gather(0, best)[0]


def medusa_losses(model, input_ids: torch.Tensor, loss_mask: torch.Tensor, out: GPTOutput,
                  decay: float = 0.8, return_logits: bool = False, token_loss: bool = False) -> Dict[str, object]:
    """Medusa: per-head cross-entropy against the ground-truth token k+2 ahead, weighted decay^k.

    Logits stay vocab-parallel (megatron's ``vocab_parallel_cross_entropy``): K heads x full vocabulary are
    never gathered unless ``return_logits``. ``token_loss``: also the per-token loss [b, s] (head k row t at label
    position t + k + 1).
    """
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    from nemo_spec.models.gpt import gather_vocab

    local = model.medusa_logits(out.hidden.detach(), gather=False)  # [K, b, s, V/tp]
    total = torch.zeros((), device=input_ids.device)
    step_losses: List[torch.Tensor] = []
    step_acc: List[torch.Tensor] = []
    b, s = input_ids.shape
    tok = torch.zeros(b, s, dtype=torch.float32, device=input_ids.device) if token_loss else None
    for k in range(local.shape[0]):
        target = shift_left(input_ids, k + 2)
        mask = shifted_mask(loss_mask, k + 2)
        ce = vocab_parallel_cross_entropy(local[k].float().clone(), target)  # it works in place on its input
        loss_k = masked_mean(ce, mask)
        total = total + (decay ** k) * loss_k
        add_token_losses(tok, ce.t(), mask.t(), k + 1, decay ** k)
        step_losses.append(loss_k.detach())
        step_acc.append(masked_mean((vocab_parallel_argmax(local[k]) == target).float(), mask))
    res: Dict[str, object] = {"loss": total, "step_losses": step_losses, "step_acc": step_acc}
    if tok is not None:
        res["token_loss"] = tok
    if return_logits:
        res.update(base_logits=out.logits.detach() if out.logits is not None else None,
                   step_logits=[gather_vocab(x) for x in local.unbind(0)])
    return res
