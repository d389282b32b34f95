"""Speculative drafts at TP=2 (torchrun, gloo), save -> load round trips, and scripts/gpt_speculate.py end to end."""
import json

import pytest
import torch

from nemo_spec.checkpoint import load_model, read_checkpoint_config, save_checkpoint
from nemo_spec.checkpoint.tp import is_tensor_entry
from nemo_spec.models import build_gpt
from nemo_spec.speculative import SpeculativeGPT
from tests.helpers import ROOT, run_torchrun, tiny_llama
from tests.speculative_utils import make_spec

ALGS = ["eagle1", "eagle3", "medusa", "peagle", "dflash"]


def _draft_logits(m, x):
    """The draft's logits on ``x`` (gathered over TP): Medusa heads; DFlash's block anchored at the last token with
    the earlier positions as context; otherwise one draft pass with the base features."""
    with torch.no_grad():
        out = m.base_forward(x)
        if m.algorithm == "medusa":
            return m.medusa_logits(out.hidden)
        feats = m.fuse(m.base_features(out))
        if m.algorithm == "dflash":
            from nemo_spec.speculative.dflash import DFlashContext

            d, (b, p), B = m.eagle_module, (x.shape[0], x.shape[1] - 1), m.spec_config.block_size
            tok = torch.full((b, B), d.mask_token_id, dtype=torch.long)
            tok[:, 0] = x[:, p]
            ctx = DFlashContext(position_ids=torch.arange(p, p + B)[None].expand(b, B),
                                target=feats[:, :p].transpose(0, 1), ctx_position_ids=torch.arange(p)[None].expand(b, p))
            return d(m.gpt, tok, ctx)[1]
        return m.draft_step(x, feats)[1]


def _losses(m, x, mask=None, **kw):
    """Training losses with the sampled objectives' draws (P-EAGLE COD, DFlash anchors) fixed by a seeded generator."""
    return m.training_losses(x, mask, generator=torch.Generator().manual_seed(0), **kw)


def _outputs(res):
    """The per-element draft outputs a loss dict carries: step logits, or DFlash's block hidden states."""
    return [t.detach() for t in res["step_logits"]] if "step_logits" in res else [res["hidden"].detach()]


@pytest.mark.parametrize("alg", ALGS)
def test_save_load_identical_outputs(alg, tmp_path):
    m = make_spec(tiny_llama(num_layers=4), alg)
    if alg in ("eagle3", "peagle"):
        m.set_draft_vocab(torch.arange(96, dtype=torch.float) % 7, reinit_head=False)
    x = torch.randint(0, 96, (2, 9))
    path = save_checkpoint(m, tmp_path / "ck")
    cfg = read_checkpoint_config(path)
    assert cfg["speculative"] == m.spec_config.to_dict()
    loaded = load_model(path)
    assert isinstance(loaded, SpeculativeGPT) and loaded.spec_config == m.spec_config
    assert torch.equal(_draft_logits(loaded, x), _draft_logits(m, x))
    assert torch.equal(loaded.d2t, m.d2t) and torch.equal(loaded.draft_vocab_mask(), m.draft_vocab_mask())
    with torch.no_grad():
        a, b = _losses(loaded, x)["loss"], _losses(m, x)["loss"]
    assert torch.equal(a, b)


def test_tp2_matches_tp1_and_tp2_checkpoint_loads_at_tp1(tmp_path):
    x = torch.randint(0, 96, (2, 10), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(x)
    mask[:, :2] = 0
    cases, models = {}, {}
    for alg in ALGS:
        m = make_spec(tiny_llama(num_layers=4), alg)
        if alg in ("eagle3", "peagle"):
            m.set_draft_vocab(torch.arange(96, dtype=torch.float).flip(0) % 11, reinit_head=False)
        res = _losses(m, x, mask, return_logits=True)
        res["loss"].backward()
        cases[alg] = {
            "config": m.model_config.to_dict(), "spec": m.spec_config.to_dict(),
            "state_dict": {k: v for k, v in m.state_dict().items() if is_tensor_entry(k, v)},
            "outputs": _outputs(res), "loss": float(res["loss"].detach()),
            "grads": {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None},
            "num_draft_params": m.num_draft_parameters(), "draft_logits": _draft_logits(m, x),
        }
        models[alg] = m
    blob = tmp_path / "blob.pt"
    torch.save({"cases": cases, "input_ids": x, "loss_mask": mask}, blob)
    out = run_torchrun(ROOT / "tests" / "dist_scripts" / "spec_tp2.py", [blob, tmp_path / "tp2"], timeout=300)
    for alg in ALGS:
        assert f"SPEC_TP2_OK {alg}" in out
        path = tmp_path / "tp2" / alg
        assert read_checkpoint_config(path)["tp_size_saved"] == 2
        loaded = load_model(path, tp_size=1)
        assert (_draft_logits(loaded, x) - cases[alg]["draft_logits"]).abs().max() < 1e-5
        sd = loaded.state_dict()
        assert all(torch.equal(sd[k], v) for k, v in cases[alg]["state_dict"].items())


def test_gpt_speculate_end_to_end(tmp_path, capsys):
    from nemo_spec.speculative.cli import main

    torch.manual_seed(0)
    base = build_gpt(tiny_llama(num_layers=4))
    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 256}))
    (tok / "tokenizer.json").write_text("{}")
    src = save_checkpoint(base, tmp_path / "base", tokenizer_dir=tok)
    counts = tmp_path / "counts.json"
    counts.write_text(json.dumps([float((i * 37) % 96) for i in range(96)]))
    # errors come before any loading and name the problem
    assert main(["--model_path", str(src), "--export_dir", str(tmp_path / "x"), "--num_eagle_layers", "1",
                 "--num_medusa_heads", "2"]) == 2
    err = capsys.readouterr().err
    lines = err.splitlines()  # the error in one line, then the --debug hint every script prints
    assert len(lines) == 2 and lines[0].startswith("error: ") and "both EAGLE" in lines[0], err
    assert lines[1] == "(run with --debug for the full traceback)"
    assert main(["--model_path", str(src), "--export_dir", str(tmp_path / "x"), "--algorithm", "eagle3",
                 "--draft_vocab_size", "500"]) == 2
    assert "error: draft_vocab_size=500" in capsys.readouterr().err and not (tmp_path / "x").exists()
    # malformed --token_counts files: one-line errors (were JSONDecodeError / UnpicklingError / ValueError tracebacks)
    for name, data, kind in (("bad.json", b"[1, 2,", "JSON list"), ("bad.pt", b"garbage", "torch.save"),
                             ("words.json", json.dumps(["a"] * 96).encode(), "JSON list")):
        (tmp_path / name).write_bytes(data)
        assert main(["--model_path", str(src), "--export_dir", str(tmp_path / "x"), "--algorithm", "eagle3",
                     "--draft_vocab_size", "32", "--token_counts", str(tmp_path / name)]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: --token_counts {tmp_path / name}: not a") and kind in err, err
    # EAGLE-3 with a frequency-based draft vocabulary (in-process: same code path as the script)
    assert main(["--model_path", str(src), "--export_dir", str(tmp_path / "e3"), "--algorithm", "eagle3",
                 "--num_eagle_layers", "1", "--draft_vocab_size", "32", "--token_counts", str(counts)]) == 0
    m = load_model(tmp_path / "e3")
    assert isinstance(m, SpeculativeGPT) and m.spec_config.draft_vocab_size == 32
    expect_ids = torch.tensor(sorted(range(96), key=lambda i: (-((i * 37) % 96), i))[:32]).sort().values
    assert torch.equal(m.draft_vocab_ids(), expect_ids)
    assert all(torch.equal(m.gpt.state_dict()[k], v) for k, v in base.state_dict().items() if is_tensor_entry(k, v))
    assert (tmp_path / "e3" / "tokenizer" / "tokenizer.json").is_file()
    cfg = read_checkpoint_config(tmp_path / "e3")
    assert cfg["speculative"]["algorithm"] == "eagle3" and cfg["speculate_source"] == str(src)
    # existing export dir without --overwrite
    assert main(["--model_path", str(src), "--export_dir", str(tmp_path / "e3"), "--algorithm", "eagle1"]) == 2
    assert "already exists" in capsys.readouterr().err
    # the script itself under torchrun TP=2, NeMo spelling -> Medusa
    run_torchrun(ROOT / "scripts" / "gpt_speculate.py",
                 ["--model_path", src, "--export_dir", tmp_path / "med", "--num_eagle_layers", "0",
                  "--num_medusa_heads", "2", "--tp_size", "2"], timeout=240)
    med = load_model(tmp_path / "med", tp_size=1)
    assert med.algorithm == "medusa" and len(med.medusa_heads.heads) == 2
    assert read_checkpoint_config(tmp_path / "med")["tp_size_saved"] == 2
    x = torch.randint(0, 96, (1, 6))
    with torch.no_grad():  # fresh Medusa heads reproduce the base head exactly, after a TP=2 save
        out = med.base_forward(x)
        assert torch.allclose(med.medusa_logits(out.hidden)[1], out.logits, atol=1e-5)
