"""GPU checks (CUDA, bf16, nccl): skipped on CPU-only machines, run by the device check script."""
import pytest
import torch

from nemo_spec.models import build_gpt, gpt_forward
from tests.helpers import tiny_llama

pytestmark = pytest.mark.gpu


def test_cuda_bf16_forward_close_to_fp32():
    from nemo_spec._cpu import apply_cpu_workarounds

    assert apply_cpu_workarounds() is False  # never patched when CUDA exists
    torch.manual_seed(0)
    cfg = tiny_llama()
    m32 = build_gpt(cfg).eval()
    assert next(m32.parameters()).is_cuda
    m16 = build_gpt(cfg, params_dtype=torch.bfloat16).eval()
    m16.load_state_dict({k: v.to(torch.bfloat16) if v.is_floating_point() else v
                         for k, v in m32.state_dict().items() if isinstance(v, torch.Tensor)}, strict=False)
    x = torch.randint(0, cfg.vocab_size, (2, 16), device="cuda")
    with torch.no_grad():
        a = gpt_forward(m32, x).logits.float()
        b = gpt_forward(m16, x).logits.float()
    assert b.dtype == torch.float32 and torch.isfinite(b).all()
    assert (a - b).abs().max() < 0.1
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() > 0.9


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs for nccl TP=2")
def test_nccl_tp2_logits_equal_tp1(tmp_path):
    from nemo_spec.checkpoint.tp import is_tensor_entry
    from tests.helpers import ROOT, run_torchrun

    torch.manual_seed(0)
    cfg = tiny_llama()
    m = build_gpt(cfg).eval()
    x = torch.randint(0, cfg.vocab_size, (2, 9), device="cuda")
    with torch.no_grad():
        logits = gpt_forward(m, x).logits
    sd = {k: v.cpu() for k, v in m.state_dict().items() if is_tensor_entry(k, v)}
    path = tmp_path / "blob.pt"
    torch.save({"config": cfg.to_dict(), "state_dict": sd, "input_ids": x.cpu(), "logits": logits.cpu()}, path)
    assert "TP2_MAX_ERR" in run_torchrun(ROOT / "tests" / "dist_scripts" / "tp_logits.py", [path])


def test_transformer_engine_spec_base_trains_a_draft_through_its_own_forward():
    """Every NeMo / Megatron-LM GPU user's base: megatron's Transformer Engine layer spec (fused layer norm in
    linear_qkv / linear_fc1, TEDotProductAttention). The draft trains on the model's own forward; generation
    refuses it until converted, and the conversion reproduces its logits."""
    pytest.importorskip("transformer_engine", reason="Transformer Engine not installed")
    import torch.nn.functional as F
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    from nemo_spec.models.foreign import ForeignSpecError, foreign_forward, is_project_spec, to_project_spec
    from nemo_spec.speculative import SpeculativeTransform

    torch.manual_seed(0)
    cfg = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                            ffn_hidden_size=128, normalization="RMSNorm", gated_linear_unit=True,
                            activation_func=F.silu, add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0,
                            init_method_std=0.05)
    gpt = GPTModel(cfg, get_gpt_layer_with_transformer_engine_spec(), vocab_size=128, max_sequence_length=64,
                   position_embedding_type="rope", share_embeddings_and_output_weights=False).cuda()
    assert not is_project_spec(gpt)
    x = torch.randint(0, 128, (2, 16), device="cuda")
    pos = torch.arange(16, device="cuda")[None].expand(2, 16)
    with torch.no_grad():
        own = gpt(x, pos, None)
        out = foreign_forward(gpt, x)
    assert torch.equal(out.logits, own)
    model = SpeculativeTransform(num_eagle_layers=1, num_medusa_heads=0)(gpt)
    loss = model.training_losses(x)["loss"]
    loss.backward()
    assert all(p.grad is not None for p in model.draft_parameters() if p.dim() > 1)
    assert all(p.grad is None for p in model.gpt.parameters())
    from nemo_spec.inference import SamplingParams, generate

    with pytest.raises(ForeignSpecError):
        generate(model, [[1, 2, 3]], SamplingParams(max_new_tokens=4), method="eagle")
    conv = to_project_spec(model)
    with torch.no_grad():
        got = gpt_forward(conv.gpt, x).logits
    assert torch.allclose(got, own, atol=1e-4, rtol=1e-4)
