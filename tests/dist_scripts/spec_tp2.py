"""Under torchrun (2 procs): TP=2 speculative models loaded from TP=1 weights reproduce TP=1 draft logits, losses
and (gathered) draft gradients; a TP=2 save_checkpoint reloads identically at TP=2 (and is checked at TP=1 by the
parent test)."""
import sys

import torch
import torch.distributed as dist


def _grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def main() -> None:
    from megatron.core import parallel_state

    from nemo_spec import parallel
    from nemo_spec.checkpoint import load_model, save_checkpoint
    from nemo_spec.checkpoint.tp import load_full_state_dict, merge_state_dicts
    from nemo_spec.config import ModelConfig, SpeculativeConfig
    from nemo_spec.models import build_gpt
    from nemo_spec.speculative import SpeculativeTransform

    blob = torch.load(sys.argv[1], weights_only=False)
    out_dir = sys.argv[2]
    parallel.initialize(tensor_parallel_size=2)
    rank = dist.get_rank()
    for alg, case in blob["cases"].items():
        cfg = ModelConfig.from_dict(case["config"])
        spec = SpeculativeConfig.from_dict(case["spec"])
        gated = cfg.activation == "swiglu"
        model = SpeculativeTransform(config=spec)(build_gpt(cfg))
        load_full_state_dict(model, case["state_dict"], gated)
        x, mask = blob["input_ids"], blob["loss_mask"]
        res = model.training_losses(x, mask, return_logits=True)
        res["loss"].backward()
        for i, (a, b) in enumerate(zip(res["step_logits"], case["step_logits"])):
            err = (a.detach() - b).abs().max().item()
            assert a.shape == b.shape and err < 1e-4, (alg, i, err)
        loss = float(res["loss"].detach())
        assert abs(loss - case["loss"]) < 1e-4, (alg, loss, case["loss"])
        shards = [None, None]
        dist.all_gather_object(shards, _grads(model), group=parallel_state.get_tensor_model_parallel_group())
        full = merge_state_dicts(shards, gated)
        assert set(full) == set(case["grads"]), (alg, sorted(set(full) ^ set(case["grads"]))[:5])
        for k, g in case["grads"].items():
            err = (full[k] - g).abs().max().item()
            assert err < 1e-4 * max(1.0, g.abs().max().item()), (alg, k, err)
        assert all(p.grad is None for p in model.gpt.parameters())
        local = model.num_draft_parameters()
        assert local < case["num_draft_params"], (alg, local)  # sharded draft: less than the full count per rank
        if alg == "eagle3":
            assert torch.equal(model.d2t, case["state_dict"]["eagle_module.d2t"])
            assert int(model.draft_vocab_mask().sum()) == model.draft_vocab_size
        if alg in ("eagle1", "eagle3"):
            with torch.no_grad():
                feats = model.fuse(model.base_features(model.base_forward(x)))
                logits = model.draft_step(x, feats)[1]
        else:
            with torch.no_grad():
                logits = model.medusa_logits(model.base_forward(x).hidden)
        assert (logits - case["draft_logits"]).abs().max().item() < 1e-4, alg
        path = save_checkpoint(model, f"{out_dir}/{alg}")
        reloaded = load_model(path, tp_size=2)
        with torch.no_grad():
            again = reloaded.training_losses(x, mask, return_logits=True)
        for a, b in zip(again["step_logits"], res["step_logits"]):
            assert torch.equal(a, b.detach()), alg
        if rank == 0:
            print(f"SPEC_TP2_OK {alg} draft_params_rank0={local}")
    parallel.destroy()


if __name__ == "__main__":
    main()
