"""Under torchrun (2 procs, gloo): P-EAGLE and DFlash draft training through the recipe at TP=2 -- 2 steps with a
checkpoint, resumed to 4 with a tau validation by real decoding, the final checkpoint written at TP=2 (the parent
compares it with an uninterrupted TP=1 run) --, at TP=1 x DP=2 (replicas stay identical), and offline at TP=2 from
base states precomputed at TP=2 (the parent trains from the same states at TP=1)."""
import sys
from pathlib import Path

import torch
import torch.distributed as dist


def main():
    from megatron.core import parallel_state as ps

    from tests.helpers import same_across_ranks

    from nemo_spec.training import train
    from tests.train_utils import parallel_draft_config

    inits, data, out = Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
    for alg in ("peagle", "dflash"):
        model_path = inits / f"{alg}_init"  # the draft attached at TP=1 by the parent
        def tp2(steps):
            return parallel_draft_config(out / f"{alg}_tp2", alg, model_path, data, steps, tensor_parallel_size=2)

        first = train(tp2(2), save_final=False)
        assert first.trainer.global_step == 2
        res = train(tp2(4), save_final=True)  # resumes from the step-2 checkpoint
        assert ps.get_tensor_model_parallel_world_size() == 2 and res.trainer.global_step == 4
        group = ps.get_tensor_model_parallel_group()
        sharded = qk = 0
        for name, p in res.module.model.draft.named_parameters():
            if getattr(p, "tensor_model_parallel", False):
                sharded += 1
                assert not same_across_ranks(group, p.detach()), f"{alg}: TP-sharded {name} identical on both ranks"
            else:  # incl. DFlash's per-head q/k norms, whose gradients each rank holds only in part
                qk += "q_layernorm" in name or "k_layernorm" in name
                assert same_across_ranks(group, p.detach()), f"{alg}: replicated {name} diverged across TP ranks"
        assert sharded > 0 and (qk > 0) == (alg == "dflash"), (alg, sharded, qk)
        steps = [s for s, _ in res.tau_history]
        assert 4 in steps and all(t >= 1.0 for _, t in res.tau_history), (alg, res.tau_history)
        assert same_across_ranks(group, torch.tensor([t for _, t in res.tau_history]))
        del first, res

        dp = train(parallel_draft_config(out / f"{alg}_dp2", alg, model_path, data, 2), save_final=False)
        assert ps.get_tensor_model_parallel_world_size() == 1 and ps.get_data_parallel_world_size() == 2
        for name, p in dp.module.model.draft.named_parameters():
            assert same_across_ranks(ps.get_data_parallel_group(), p.detach()), f"{alg}: DP replica {name} diverged"
        assert torch.isfinite(dp.trainer.callback_metrics["train_loss"])
        del dp

        off = parallel_draft_config(out / f"{alg}_offline_tp2", alg, model_path, data, 2, tensor_parallel_size=2)
        off.offline, off.data.offline_dir = True, str(out / f"{alg}_states")  # precomputed here at TP=2
        assert train(off, save_final=True).trainer.global_step == 2
        if dist.get_rank() == 0:
            print(f"PARALLEL_DRAFT_TP2_OK {alg}")


if __name__ == "__main__":
    main()
