"""Under torchrun (2 procs): Qwen3 / Qwen3-MoE / Mixtral HF dirs at TP=2 (logits == transformers'), exported again;
then, in the same launch, the MoE dirs at expert parallelism EP=2 against EP=1.

argv: triples (HF_DIR, BLOB with input_ids/logits, EXPORT_DIR), then optionally ``--ep`` and triples
(MOE_HF_DIR, BLOB, WORK_DIR). MoE experts are tensor-parallel at TP=2 (each rank holds a shard of every expert) and
expert-parallel at EP=2 (each rank holds 2 of the 4 experts), allgather token dispatcher both times.

EP phase, per MoE dir: at TP=1/EP=1 (two data-parallel replicas) the reference logits, greedy AR tokens and an
EAGLE-3 draft; at EP=2: logits == EP=1 == transformers', HF export (WORK_DIR/hf, compared by the test), greedy AR and
EAGLE-3 speculative tokens == EP=1 AR, two draft training steps on rank-dependent batch lengths (base frozen), and a
torch_dist save (first MoE dir only: WORK_DIR/ckpt, loaded by the test at EP=1) reloaded at EP=2.
"""
import sys

import torch

from nemo_spec import parallel
from nemo_spec.checkpoint import load_model, save_checkpoint
from nemo_spec.checkpoint.hf import export_hf, load_hf
from nemo_spec.models import gpt_forward

PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [11, 3, 40]]
EAGLE = {"depth": 3, "top_k": 3, "total_tokens": 8, "num_draft_tokens": 3}


def tp2_phase(args) -> None:
    parallel.initialize(tensor_parallel_size=2)
    rank0 = torch.distributed.get_rank() == 0
    for hf_dir, blob_path, out_dir in zip(args[0::3], args[1::3], args[2::3]):
        blob = torch.load(blob_path)
        model = load_hf(hf_dir).eval()
        with torch.no_grad():
            for fast in (True, False):
                err = (gpt_forward(model, blob["input_ids"], fast=fast).logits - blob["logits"]).abs().max().item()
                assert err < 1e-4, (hf_dir, fast, err)
        export_hf(model, out_dir)
        if rank0:
            print(f"FAMILIES_TP2_OK {hf_dir} {err:.3e}")


def _eagle3(base):
    from nemo_spec.speculative import SpeculativeTransform

    torch.manual_seed(0)
    model = SpeculativeTransform(algorithm="eagle3", aux_layers=[0, 1, 2], draft_vocab_size=48)(base)
    v = model.gpt.nemo_spec_config.vocab_size
    model.set_draft_vocab(torch.linspace(1, 0, v, dtype=torch.float64))
    return model.eval()


def _tokens(model, method="ar"):
    from nemo_spec.inference import SamplingParams, generate

    sp = SamplingParams(max_new_tokens=8)
    opts = EAGLE if method != "ar" else None
    with torch.no_grad():
        return [o.tokens for o in generate(model, PROMPTS, sp, method=method, options=opts)]


def ep1_reference(hf_dir, blob):
    """TP=1, EP=1 (each rank a full replica): logits, greedy AR tokens, the EAGLE-3 draft's state."""
    parallel.initialize(tensor_parallel_size=1, expert_parallel_size=1)
    base = load_hf(hf_dir).eval()
    with torch.no_grad():
        logits = gpt_forward(base, blob["input_ids"]).logits
    ar = _tokens(base)
    spec = _eagle3(base)
    draft = {k: v.clone() for k, v in spec.state_dict().items()
             if torch.is_tensor(v) and not k.startswith("gpt.") and not k.endswith("_extra_state")}
    assert _tokens(spec, "eagle") == ar
    return logits, ar, draft


def ep2_checks(hf_dir, blob, work, logits1, ar1, draft, checkpoint: bool) -> str:
    from megatron.core import parallel_state as ps

    from nemo_spec.training.module import pad_for_expert_parallel

    parallel.initialize(tensor_parallel_size=1, expert_parallel_size=2)
    rank = torch.distributed.get_rank()
    assert parallel.ep_size() == 2 and parallel.ep_rank() == rank and ps.get_data_parallel_world_size() == 2
    base = load_hf(hf_dir).eval()
    e = base.nemo_spec_config.num_moe_experts
    layer0 = base.decoder.layers[0].mlp
    assert len(layer0.experts.local_experts) == e // 2 and layer0.local_expert_indices == [
        rank * (e // 2) + i for i in range(e // 2)], layer0.local_expert_indices
    # this rank's local expert i is global expert rank * (E / EP) + i: compare with the EP=1 full state dict
    with torch.no_grad():
        logits = gpt_forward(base, blob["input_ids"]).logits
        slow = gpt_forward(base, blob["input_ids"], fast=False).logits
    d_ep = (logits - logits1).abs().max().item()
    d_hf = max((logits - blob["logits"]).abs().max().item(), (slow - blob["logits"]).abs().max().item())
    assert d_ep < 1e-5 and d_hf < 1e-4, (hf_dir, d_ep, d_hf)
    export_hf(base, f"{work}/hf")
    # the gathered full state dict is the same on every EP rank (rank 0's is what export_hf wrote)
    from nemo_spec.checkpoint.tp import gather_full_state_dict
    full = gather_full_state_dict(base, gated=True)
    every: list = [None, None]
    torch.distributed.all_gather_object(every, full)
    assert every[0].keys() == every[1].keys() and all(torch.equal(every[0][k], every[1][k]) for k in full), \
        "gather_full_state_dict differs between EP ranks"
    ar = _tokens(base)
    assert ar == ar1, (ar, ar1)

    spec = _eagle3(base)
    missing = spec.load_state_dict(draft, strict=False)
    assert not missing.unexpected_keys, missing.unexpected_keys
    assert _tokens(spec, "eagle") == ar1
    assert _tokens(spec, "eagle_tree") == ar1
    # adaptive speculation times its own steps on each rank: the chosen draft length must be the same on every EP
    # rank (the MoE dispatcher gathers equal-shaped blocks), else the ranks' verify shapes differ
    from nemo_spec.inference import SamplingParams, generate
    with torch.no_grad():
        adaptive = [o.tokens for o in generate(spec, PROMPTS, SamplingParams(max_new_tokens=8), method="eagle",
                                               options={**EAGLE, "adaptive": True})]
        sampled = [o.tokens for o in generate(spec, PROMPTS, SamplingParams(max_new_tokens=8, temperature=1.0),
                                              method="eagle", options=EAGLE)]  # unseeded rows
    assert adaptive == ar1, (adaptive, ar1)
    both: list = [None, None]
    torch.distributed.all_gather_object(both, sampled)
    assert both[0] == both[1], both

    # two draft steps; the EP ranks (= data-parallel ranks here) see batches of different lengths
    g = torch.Generator().manual_seed(10 + rank)
    s = 12 if rank == 0 else 9
    batch = {"input_ids": torch.randint(0, spec.gpt.nemo_spec_config.vocab_size, (2, s), generator=g),
             "loss_mask": torch.ones(2, s, dtype=torch.long)}
    padded = pad_for_expert_parallel(batch)
    assert padded["input_ids"].shape == (2, 12) and padded["loss_mask"][:, s:].sum() == 0
    with torch.inference_mode():  # megatron's token buffer is now (re)allocated as an inference tensor
        gpt_forward(spec.gpt, torch.zeros(2, 40, dtype=torch.long))
    base_before = {k: v.clone() for k, v in spec.gpt.state_dict().items() if torch.is_tensor(v)}
    draft_before = [p.detach().clone() for p in spec.draft_parameters()]
    opt = torch.optim.AdamW(list(spec.draft_parameters()), lr=3e-3)
    spec.train()
    losses = []
    for _ in range(2):
        loss = spec.training_losses(padded["input_ids"], padded["loss_mask"].bool())["loss"]
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    spec.eval()
    assert all(torch.isfinite(torch.tensor(losses))), losses
    assert all(torch.equal(v, spec.gpt.state_dict()[k]) for k, v in base_before.items())  # base frozen
    assert any(not torch.equal(a, b.detach()) for a, b in zip(draft_before, spec.draft_parameters()))
    assert all(p.grad is None or not p.requires_grad for p in spec.gpt.parameters())

    if not checkpoint:
        return f"{d_ep:.1e} {d_hf:.1e} losses {losses[0]:.3f} {losses[1]:.3f}"
    # torch_dist checkpoint of the EP=2 base: saved here, reloaded at EP=2 here and at EP=1 by the test
    save_checkpoint(base, f"{work}/ckpt")
    again = load_model(f"{work}/ckpt").eval()
    assert parallel.ep_size() == 2
    with torch.no_grad():
        assert torch.equal(gpt_forward(again, blob["input_ids"]).logits, logits)
    return f"{d_ep:.1e} {d_hf:.1e} losses {losses[0]:.3f} {losses[1]:.3f}"


def ep_phase(args) -> None:
    for i, (hf_dir, blob_path, work) in enumerate(zip(args[0::3], args[1::3], args[2::3])):
        blob = torch.load(blob_path)
        logits1, ar1, draft = ep1_reference(hf_dir, blob)
        info = ep2_checks(hf_dir, blob, work, logits1, ar1, draft, checkpoint=i == 0)
        if torch.distributed.get_rank() == 0:
            print(f"FAMILIES_EP2_OK {hf_dir} {info}")


def main() -> None:
    args = sys.argv[1:]
    tp_args, ep_args = (args[:args.index("--ep")], args[args.index("--ep") + 1:]) if "--ep" in args else (args, [])
    tp2_phase(tp_args)
    if ep_args:
        ep_phase(ep_args)
    parallel.destroy()


if __name__ == "__main__":
    main()
