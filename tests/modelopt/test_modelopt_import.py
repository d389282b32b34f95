"""Drafts trained with NVIDIA Model Optimizer load into nemo_spec: exports written by ModelOpt's own code
(tests/modelopt/make_exports.py, nvidia-modelopt 0.47.0 in its side environment) imported with ``import_draft``.

Runs with ``make test-modelopt`` (which builds the exports and points NEMO_SPEC_MODELOPT_EXPORTS at them); skipped
otherwise. Every comparison is against numbers ModelOpt's run produced: its own Medusa forward, and its EAGLE-3 draft
computed from the exported tensors with the layer-0 norm vLLM / SGLang / nemo_spec apply (``serving_*``; ModelOpt 0.47's
Hugging Face EagleModule also runs input_layernorm on the fused feature, ``modelopt_*``: make_exports.py checks its
hand-written forward against ModelOpt's own to 1e-4 in that mode, so the two differ only by that norm).
"""
from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from nemo_spec.checkpoint import load_model
from nemo_spec.export import ExportError, detect_draft_format, import_draft
from nemo_spec.speculative import SpeculativeTransform

EXPORTS = os.environ.get("NEMO_SPEC_MODELOPT_EXPORTS")
pytestmark = pytest.mark.skipif(not EXPORTS, reason="ModelOpt exports not built: run make test-modelopt")
EAGLE = ["eagle3_1l_full", "eagle3_1l_d2t", "eagle3_2l_d2t", "eagle3_1l_yarn"]


@pytest.fixture(scope="module")
def ref():
    torch.set_num_threads(1)
    return torch.load(Path(EXPORTS) / "reference.pt", weights_only=False)


def _eagle(r, name, **kw):
    vd = None if r["d2t"] is None else r["d2t"].numel()
    base = load_model(str(Path(EXPORTS) / "base"))
    return SpeculativeTransform(algorithm="eagle3", num_eagle_layers=2 if "_2l_" in name else 1,
                                aux_layers=kw.pop("aux_layers", r["aux_layer_ids"]), draft_vocab_size=vd, **kw)(base).eval()


def _draft_logits(m, ref, r):
    with torch.no_grad():
        feats = m.fuse(m.base_features(m.base_forward(ref["_meta"]["input_ids"])))
        return m.draft_step(r["eagle_ids"], feats)[1]


@pytest.mark.parametrize("name", EAGLE)
def test_modelopt_eagle3_exports_import_exactly(ref, name, caplog):
    r = ref[name]
    m = _eagle(r, name)
    with caplog.at_level(logging.WARNING, logger="nemo_spec.export.eagle"):
        assert import_draft(m, Path(EXPORTS) / name) == "eagle3"
    lg = _draft_logits(m, ref, r)
    assert (lg - r["serving_logits"]).abs().max() < 1e-4
    # ModelOpt's own forward differs by its extra layer-0 norm only: said on import
    assert (lg - r["modelopt_logits"]).abs().max() > 0.1
    assert "input_layernorm and then hidden_norm" in caplog.text
    # ModelOpt writes its default eagle_export_rope_scaling (YaRN x32) into config.json: nemo_spec keeps the base's
    # RoPE the draft was trained with, and warns that an engine would not
    assert ("rope_scaling={'rope_type': 'yarn'" in caplog.text) == (name == "eagle3_1l_yarn")


def test_modelopt_ids_are_layer_outputs_and_other_layers_are_refused(ref):
    r = ref["eagle3_1l_d2t"]  # ModelOpt aux ids [0, 2, 4]: 0-based outputs (hf_eagle.py:208-232, 402-406)
    conf = json.loads((Path(EXPORTS) / "eagle3_1l_d2t" / "config.json").read_text())
    assert conf["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 2, 4] == r["aux_layer_ids"]
    assert "eagle_aux_hidden_state_layer_ids" not in conf  # so vLLM would read them as layer inputs
    with pytest.raises(ExportError, match=r"reads base layers \[0, 2, 4\].*ModelOpt.*fed layers \[1, 3, 4\].*"
                                          r"aux_layers=\[0, 2, 4\]"):
        import_draft(_eagle(r, "eagle3_1l_d2t", aux_layers=[1, 3, 4]), Path(EXPORTS) / "eagle3_1l_d2t")
    m = _eagle(r, "eagle3_1l_d2t", aux_layers=[4, 0, 2])  # same layers, other order: fc blocks reordered
    import_draft(m, Path(EXPORTS) / "eagle3_1l_d2t")
    assert (_draft_logits(m, ref, r) - r["serving_logits"]).abs().max() < 1e-4


def test_megatron_flow_drafts_without_lm_head_or_d2t(ref, tmp_path):
    """ModelOpt's Megatron export (Megatron-LM examples/post_training/modelopt) writes no lm_head for a
    full-vocabulary draft that predicts with the base's (unified_export_megatron.py:917-918) and never writes d2t
    (:919 tests ``hasattr(eagle_module, "dt2")``): the base's output layer stands in, and the draft vocabulary cache
    is passed as d2t=."""
    r = ref["eagle3_1l_full"]
    d = Path(shutil.copytree(Path(EXPORTS) / "eagle3_1l_full", tmp_path / "full"))
    w = load_file(str(d / "model.safetensors"))
    base = load_model(str(Path(EXPORTS) / "base"))
    assert torch.equal(w.pop("lm_head.weight"), base.output_layer.weight.detach())  # a copy of the base's, here
    save_file(w, str(d / "model.safetensors"))
    m = _eagle(r, "eagle3_1l_full")
    import_draft(m, d)
    assert (_draft_logits(m, ref, r) - r["serving_logits"]).abs().max() < 1e-4

    r = ref["eagle3_1l_d2t"]
    d = Path(shutil.copytree(Path(EXPORTS) / "eagle3_1l_d2t", tmp_path / "d2t"))
    w = load_file(str(d / "model.safetensors"))
    cache = tmp_path / "draft_vocab_cache.pt"
    torch.save(w.pop("d2t"), cache)  # what calibrate_frequent_vocab saves and load_draft_vocab_cache reads
    save_file(w, str(d / "model.safetensors"))
    with pytest.raises(ExportError, match=r"no 'd2t' mapping .*d2t=<draft_vocab_cache"):
        import_draft(_eagle(r, "eagle3_1l_d2t"), d)
    m = _eagle(r, "eagle3_1l_d2t")
    import_draft(m, d, d2t=cache)
    assert (_draft_logits(m, ref, r) - r["serving_logits"]).abs().max() < 1e-4
    with pytest.raises(ExportError, match="d2t= applies to EAGLE-3"):
        import_draft(SpeculativeTransform(algorithm="medusa", num_medusa_heads=3)(load_model(str(Path(EXPORTS) / "base"))),
                     Path(EXPORTS) / "medusa", d2t=cache)


@pytest.mark.parametrize("name", ["medusa", "medusa_2l"])
def test_modelopt_medusa_whole_model_exports_import_exactly(ref, name):
    """export_hf_checkpoint of a Medusa model writes the whole model with medusa_heads.* and config.medusa: only the
    heads are read, and they give ModelOpt's own HFMedusaModel.forward logits."""
    r = ref[name]
    assert detect_draft_format(Path(EXPORTS) / name) == "medusa_modelopt"
    base = load_model(str(Path(EXPORTS) / "base"))
    m = SpeculativeTransform(algorithm="medusa", num_medusa_heads=r["num_heads"],
                             num_medusa_layers=r["num_layers"])(base).eval()
    assert import_draft(m, Path(EXPORTS) / name) == "medusa_modelopt"
    with torch.no_grad():
        lg = m.medusa_logits(m.base_forward(ref["_meta"]["input_ids"]).hidden)
    assert (lg - r["medusa_logits"]).abs().max() < 1e-4
    wrong = SpeculativeTransform(algorithm="medusa", num_medusa_heads=r["num_heads"] + 1,
                                 num_medusa_layers=r["num_layers"])(load_model(str(Path(EXPORTS) / "base")))
    with pytest.raises(ExportError, match="missing"):
        import_draft(wrong, Path(EXPORTS) / name)
