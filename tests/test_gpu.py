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
