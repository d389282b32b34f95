"""Under torchrun (2 procs): TP=2 speculative models (every algorithm) loaded from TP=1 weights reproduce TP=1 draft
logits, per-element outputs, losses and (gathered) draft gradients, with the sampled objectives' draws seeded alike;
a TP=2 save_checkpoint reloads identically at TP=2 (and is checked at TP=1 by the parent test)."""
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
    from tests.test_speculative_tp import _draft_logits, _losses as losses, _outputs

    def _losses(m, x, mask):
        return losses(m, x, mask, return_logits=True)

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
        res = _losses(model, x, mask)
        res["loss"].backward()
        if alg == "dflash":  # megatron-core's own rule (what NeMo's loop runs) sums the q/k norm grads over TP
            from megatron.core.distributed import DistributedDataParallelConfig
            from megatron.core.distributed.finalize_model_grads import _allreduce_non_tensor_model_parallel_grads
            from megatron.core.utils import get_model_config

            model.ddp_config = DistributedDataParallelConfig()  # what megatron's DDP wrapper exposes
            partial = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
            assert get_model_config(model).qk_layernorm and not model.gpt.config.qk_layernorm
            _allreduce_non_tensor_model_parallel_grads([model], get_model_config(model))
            # NeMo's shape: megatron reads the LightningModule's config (the base's: no qk_layernorm), the
            # gradients sit in main_grad, and NeMo finalises through optim.finalize_model_grads, which the
            # integration wraps (nemo_spec.parallel.sum_tp_partial_grads_in_finalize)
            from types import SimpleNamespace

            holder = SimpleNamespace(config=model.gpt.config, optim=SimpleNamespace(
                finalize_model_grads=lambda chunks: _allreduce_non_tensor_model_parallel_grads(chunks,
                                                                                            model.gpt.config)))
            assert parallel.sum_tp_partial_grads_in_finalize(holder, model)
            assert not parallel.sum_tp_partial_grads_in_finalize(holder, model)  # wrapped once
            for n, p in model.named_parameters():
                if n in partial:
                    p.main_grad = partial[n].clone()
            holder.optim.finalize_model_grads([model])
            summed = 0
            for n, p in model.named_parameters():
                if n in partial:
                    summed += not torch.equal(p.main_grad, partial[n])
                    assert torch.equal(p.main_grad, p.grad), (alg, n)  # == megatron's rule with qk_layernorm
                    del p.main_grad
            assert summed == 2 * spec.num_eagle_layers, summed  # exactly the q and k norms of each layer
            del model.ddp_config
        else:  # the training strategy's reduction: nothing to sum for the other drafts
            assert parallel.all_reduce_tp_partial_grads(model) == 0, alg
        assert len(_outputs(res)) == len(case["outputs"])
        for i, (a, b) in enumerate(zip(_outputs(res), case["outputs"])):
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
        if alg in ("eagle3", "peagle"):
            assert torch.equal(model.d2t, case["state_dict"]["eagle_module.d2t"])
            assert int(model.draft_vocab_mask().sum()) == model.draft_vocab_size
        logits = _draft_logits(model, x)
        assert (logits - case["draft_logits"]).abs().max().item() < 1e-4, alg
        path = save_checkpoint(model, f"{out_dir}/{alg}")
        reloaded = load_model(path, tp_size=2)
        with torch.no_grad():
            again = _losses(reloaded, x, mask)
        for a, b in zip(_outputs(again), _outputs(res)):
            assert torch.equal(a, b), alg
        if rank == 0:
            print(f"SPEC_TP2_OK {alg} draft_params_rank0={local}")
    parallel.destroy()


if __name__ == "__main__":
    main()
