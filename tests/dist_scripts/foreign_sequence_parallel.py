"""Under torchrun (2 procs, gloo): a megatron local-spec GPTModel at TP=2 with sequence_parallel=True (NeMo's default
at TP > 1) as the draft's base. Its decoder's outputs are each rank's slice of the sequence and its embedding
reduce-scatters along the sequence; the draft must still see every position: the base outputs, the draft
training losses (EAGLE-3, EAGLE-1, DFlash, Medusa, P-EAGLE) and the draft gradients equal those of the same weights without
sequence parallelism."""
import copy
import sys

import torch
from megatron.core.transformer import torch_norm

from nemo_spec import parallel
from nemo_spec.models import gpt_forward
from nemo_spec.speculative import SpeculativeTransform

# megatron's torch norm refuses sequence_parallel (Transformer Engine's and apex's norms take it; neither exists on
# CPU): its forward is the same either way, so it is built with the flag off
_new = torch_norm.WrappedTorchNorm.__new__


def _norm_without_sp(cls, config, *a, **k):
    c = copy.copy(config)
    c.sequence_parallel = False
    return _new(cls, c, *a, **k)


if __name__ == "__main__":
    sys.path.insert(0, sys.argv[1])
    from tests.test_foreign_spec import local_spec_gpt

    torch_norm.WrappedTorchNorm.__new__ = _norm_without_sp
    parallel.initialize(tensor_parallel_size=2)
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(1))
    one = {"num_eagle_layers": 1}
    for alg, kw in (("eagle3", one), ("eagle1", one), ("dflash", {**one, "block_size": 4, "target_layer_ids": [0]}),
                    ("medusa", {"num_medusa_heads": 2}), ("peagle", {**one, "parallel_depth": 3})):
        out = {}
        for sp in (False, True):
            gpt = local_spec_gpt(seed=3, tensor_model_parallel_size=2, sequence_parallel=sp).eval()
            base = gpt_forward(gpt, ids, aux_layers=[0, 2])
            torch.manual_seed(5)
            spec = SpeculativeTransform(algorithm=alg, **kw)(gpt)
            loss = spec.training_losses(ids)["loss"]
            loss.backward()
            grads = {n: p.grad.clone() for n, p in spec.named_parameters() if p.grad is not None}
            out[sp] = (base, float(loss), grads)
        (b0, l0, g0), (b1, l1, g1) = out[False], out[True]
        assert b1.hidden.shape == b0.hidden.shape == (2, 12, 32), b1.hidden.shape
        assert torch.allclose(b0.logits, b1.logits, atol=1e-5) and torch.allclose(b0.hidden, b1.hidden, atol=1e-5)
        assert all(torch.allclose(x, y, atol=1e-5) for x, y in zip(b0.aux_hidden, b1.aux_hidden))
        assert abs(l0 - l1) < 1e-5 * max(1.0, abs(l0)), (alg, l0, l1)
        assert g0.keys() == g1.keys() and g0, alg
        for n in g0:
            assert torch.allclose(g0[n], g1[n], atol=1e-5, rtol=1e-4), (alg, n, (g0[n] - g1[n]).abs().max())
        print(f"SEQUENCE_PARALLEL_OK {alg} rank {torch.distributed.get_rank()} loss {l1:.5f}", flush=True)
    parallel.destroy()
