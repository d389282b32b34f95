"""Under torchrun (2 procs, gloo): EAGLE-3 draft training at TP=2 (with checkpoint + resume at TP=2), then at
TP=1 x DP=2 (gradients all-reduced over the DP group); writes the DP=2 draft state for comparison."""
import sys
from pathlib import Path

import torch
import torch.distributed as dist


def _same_across(group, t):
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return all(torch.equal(parts[0], p) for p in parts[1:])


def main():
    from megatron.core import parallel_state as ps

    from tests.train_utils import small_train_config
    from nemo_spec.training import train

    model_path, data, out = sys.argv[1], sys.argv[2], Path(sys.argv[3])

    # ---- TP=2: train 4 steps (checkpoint every 2), then resume to 6 at TP=2 ----
    def tp_cfg(steps):
        c = small_train_config(out / "tp2", "eagle3", steps=steps, tensor_parallel_size=2, ckpt_every_n_steps=2)
        c.model_path, c.data.path, c.resume, c.optim.lr = model_path, data, "auto", 1e-2
        return c

    r1 = train(tp_cfg(4), save_final=False)
    assert ps.get_tensor_model_parallel_world_size() == 2 and ps.get_data_parallel_world_size() == 1
    r2 = train(tp_cfg(6), save_final=True)
    assert r2.trainer.global_step == 6, r2.trainer.global_step
    m = r2.module.model
    tp_group = ps.get_tensor_model_parallel_group()
    n_sharded = 0
    for name, p in m.draft.named_parameters():
        if getattr(p, "tensor_model_parallel", False):
            n_sharded += 1
            assert not _same_across(tp_group, p.detach()), f"TP-sharded {name} identical on both ranks"
        else:
            assert _same_across(tp_group, p.detach()), f"replicated {name} diverged across TP ranks"
    assert n_sharded > 0
    loss = r2.trainer.callback_metrics["train_loss"]
    assert torch.isfinite(loss), loss
    assert _same_across(tp_group, loss.reshape(1).float())
    del r1

    # ---- TP=1 x DP=2: micro-batch 2 per rank, global batch 4 ----
    c = small_train_config(out / "dp2", "eagle3", steps=3, global_batch_size=4)
    c.trainer.train_bs = 2
    c.model_path, c.data.path = model_path, data
    r3 = train(c, save_final=False)
    assert ps.get_data_parallel_world_size() == 2 and ps.get_tensor_model_parallel_world_size() == 1
    dp_group = ps.get_data_parallel_group()
    state = r3.module.trainable_state_dict()
    for k, v in state.items():
        assert _same_across(dp_group, v.detach().float()), f"{k} differs across DP ranks"
    if dist.get_rank() == 0:
        torch.save({k: v.detach().cpu() for k, v in state.items()}, out / "dp2_state.pt")
        print(f"TRAIN_TP2_OK final={r2.final_checkpoint} loss={float(loss):.4f}")


if __name__ == "__main__":
    main()
