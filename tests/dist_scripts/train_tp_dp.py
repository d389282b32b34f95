"""Under torchrun (2 procs, gloo): EAGLE-3 draft training at TP=2 (with checkpoint + resume at TP=2); the TP=2
training checkpoint resumed at TP=1 x DP=2 (same draft weights; continuing gives the same weights as continuing at
TP=2, and writes a DP=2 checkpoint); then plain TP=1 x DP=2 training (gradients all-reduced over the DP group);
writes the DP=2 draft state for comparison."""
import sys
from pathlib import Path

import torch
import torch.distributed as dist


def main():
    from megatron.core import parallel_state as ps

    from tests.helpers import same_across_ranks

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
            assert not same_across_ranks(tp_group, p.detach()), f"TP-sharded {name} identical on both ranks"
        else:
            assert same_across_ranks(tp_group, p.detach()), f"replicated {name} diverged across TP ranks"
    assert n_sharded > 0
    loss = r2.trainer.callback_metrics["train_loss"]
    assert torch.isfinite(loss), loss
    assert same_across_ranks(tp_group, loss.reshape(1).float())
    del r1

    # ---- the step-6 TP=2 training checkpoint resumed elsewhere: continue 6 -> 8 at TP=2, then at TP=1 x DP=2 ----
    step6 = out / "tp2" / "checkpoints" / "step0000006"

    def cont_cfg(run, tp, steps, **kw):
        c = small_train_config(out / run, "eagle3", steps=steps, tensor_parallel_size=tp, global_batch_size=4, **kw)
        c.trainer.train_bs = 2
        c.model_path, c.data.path, c.resume, c.optim.lr = model_path, data, str(step6), 1e-2
        return c

    cont_tp2 = train(cont_cfg("cont_tp2", 2, 8), save_final=True)
    assert cont_tp2.trainer.global_step == 8
    from nemo_spec.checkpoint import load_model

    loaded = train(cont_cfg("load_tp1", 1, 6), save_final=False)  # restores step 6 at TP=1, trains nothing
    assert ps.get_tensor_model_parallel_world_size() == 1 and ps.get_data_parallel_world_size() == 2
    assert loaded.trainer.global_step == 6
    ref6 = load_model(r2.final_checkpoint).draft.state_dict()  # TP=2 weights at step 6, resharded by load_model
    got6 = loaded.module.model.draft.state_dict()
    for k, v in ref6.items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(got6[k], v), f"TP=2 -> TP=1 resume: {k} differs"
    cont_tp1 = train(cont_cfg("cont_tp1", 1, 8, ckpt_every_n_steps=2), save_final=False)  # writes a DP=2 ckpt
    assert cont_tp1.trainer.global_step == 8
    ref8 = {k: v for k, v in load_model(cont_tp2.final_checkpoint).draft.state_dict().items()
            if isinstance(v, torch.Tensor) and v.is_floating_point()}
    got8 = cont_tp1.module.model.draft.state_dict()
    worst = max(float((got8[k] - v).abs().max()) for k, v in ref8.items())
    assert worst < 1e-5, f"continuing at TP=1 x DP=2 diverged from continuing at TP=2 by {worst}"
    assert any(not torch.equal(got8[k], got6[k]) for k in ref8)  # training really continued
    dp2_ckpt = out / "cont_tp1" / "checkpoints" / "step0000008"
    from megatron.core import dist_checkpointing

    keys = dist_checkpointing.load_tensors_metadata(str(dp2_ckpt))
    assert "eagle_module.fc.weight" in keys and "optimizer.state.exp_avg.eagle_module.fc.weight" in keys
    writers = {f.name.split("_")[2] for f in dp2_ckpt.glob("__*.distcp")}
    assert writers == {"0"}, f"DP replicas wrote duplicate shards: {sorted(writers)}"  # DP rank 1 holds replicas only

    # ---- TP=1 x DP=2: micro-batch 2 per rank, global batch 4; a validation at step 3 ----
    c = small_train_config(out / "dp2", "eagle3", steps=3, global_batch_size=4, val_check_interval=3)
    c.trainer.train_bs = 2
    c.model_path, c.data.path = model_path, data
    r3 = train(c, save_final=False)
    assert ps.get_data_parallel_world_size() == 2 and ps.get_tensor_model_parallel_world_size() == 1
    dp_group = ps.get_data_parallel_group()
    # each DP rank validates its own share; the logged epoch metrics are their average, the same on both ranks
    val = r3.trainer.callback_metrics
    for k in ("val_loss", "val_acc_step0"):
        assert same_across_ranks(dp_group, val[k].reshape(1).float()), f"{k} differs across DP ranks: {float(val[k])}"
    state = r3.module.trainable_state_dict()
    for k, v in state.items():
        assert same_across_ranks(dp_group, v.detach().float()), f"{k} differs across DP ranks"
    if dist.get_rank() == 0:
        torch.save({k: v.detach().cpu() for k, v in state.items()}, out / "dp2_state.pt")
        print(f"TRAIN_TP2_OK final={r2.final_checkpoint} loss={float(loss):.4f} tp2_vs_tp1_continue={worst:.2e}")


if __name__ == "__main__":
    main()
