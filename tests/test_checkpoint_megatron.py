"""nemo_spec torch_dist checkpoints: round trips, TP resharding (torchrun), atomic writes, errors."""
import json
import shutil

import pytest
import torch

from nemo_spec.checkpoint import (CheckpointConfigError, CheckpointError, detect_format, find_tokenizer_dir,
                                  load_model, read_checkpoint_config, save_checkpoint)
from nemo_spec.checkpoint import megatron as ckpt_megatron
from nemo_spec.config import ConfigError
from nemo_spec.models import build_gpt, gpt_forward
from tests.checkpoint_utils import perturb_, reshard_run, tensor_sd
from tests.helpers import tiny_gpt2, tiny_llama

TOL = 1e-6


def _logits(model, x):
    model.eval()
    with torch.no_grad():
        return gpt_forward(model, x).logits


def _same_weights(a, b):
    sa, sb = tensor_sd(a), tensor_sd(b)
    return set(sa) == set(sb) and all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.fixture(scope="module")
def llama_ckpt(tmp_path_factory):
    """A saved tiny Llama checkpoint (TP=1) with a tokenizer dir, plus the model it came from."""
    root = tmp_path_factory.mktemp("llama_ckpt")
    tok = root / "tok_src"
    tok.mkdir()
    (tok / "tokenizer.json").write_text('{"version": "1.0"}')
    (tok / "tokenizer_config.json").write_text("{}")
    torch.manual_seed(0)
    model = perturb_(build_gpt(tiny_llama()), seed=3)
    path = save_checkpoint(model, root / "ckpt", tokenizer_dir=tok, extra={"step": 12})
    return path, model


@pytest.fixture(scope="module")
def reshard():
    return reshard_run()


# ----------------------------------------------------------------------------------------------------------------
# format and round trips
# ----------------------------------------------------------------------------------------------------------------

def test_directory_is_megatron_torch_dist_plus_config(llama_ckpt):
    path, model = llama_ckpt
    names = {p.name for p in path.iterdir()}
    assert {"common.pt", "metadata.json", ".metadata", "nemo_spec_config.json", "tokenizer"} <= names
    assert any(n.endswith(".distcp") for n in names)
    meta = json.loads((path / "metadata.json").read_text())
    assert meta["sharded_backend"] == "torch_dist"
    cfg = read_checkpoint_config(path)
    assert cfg["format"] == "nemo_spec" and cfg["tp_size_saved"] == 1 and cfg["step"] == 12
    assert cfg["model"] == model.nemo_spec_config.to_dict() and "speculative" not in cfg
    assert detect_format(path) == "nemo_spec"
    assert find_tokenizer_dir(path) == path / "tokenizer"
    assert (path / "tokenizer" / "tokenizer.json").read_text() == '{"version": "1.0"}'
    assert not any(p.name.endswith(ckpt_megatron.TEMP_SUFFIX) for p in path.parent.iterdir())


def test_roundtrip_llama(llama_ckpt):
    path, model = llama_ckpt
    loaded = load_model(path)
    assert _same_weights(model, loaded)
    x = torch.randint(0, 96, (2, 7))
    assert (_logits(model, x) - _logits(loaded, x)).abs().max().item() == 0.0


def test_roundtrip_gpt2_tied_learned_positions(tmp_path):
    torch.manual_seed(1)
    model = perturb_(build_gpt(tiny_gpt2()), seed=4)
    path = save_checkpoint(model, tmp_path / "gpt2")
    loaded = load_model(str(path))
    assert loaded.share_embeddings_and_output_weights and _same_weights(model, loaded)
    x = torch.randint(0, 96, (1, 11))
    assert (_logits(model, x) - _logits(loaded, x)).abs().max().item() == 0.0
    assert find_tokenizer_dir(path) is None


def test_load_in_bfloat16(llama_ckpt):
    path, model = llama_ckpt
    loaded = load_model(path, dtype=torch.bfloat16)
    got = tensor_sd(loaded)
    assert got["decoder.layers.0.self_attention.linear_qkv.weight"].dtype == torch.bfloat16
    ref = tensor_sd(model)
    for k, v in got.items():  # (megatron's torch norms stay float32)
        assert torch.equal(v, ref[k].to(v.dtype)), k


def test_speculative_model_roundtrip(tmp_path):
    spec_mod = pytest.importorskip("nemo_spec.speculative")
    torch.manual_seed(2)
    base = perturb_(build_gpt(tiny_llama(num_layers=4)), seed=5)
    model = spec_mod.SpeculativeTransform(algorithm="eagle3", num_eagle_layers=1, draft_vocab_size=48)(base)
    perturb_(model.draft, seed=6)
    path = save_checkpoint(model, tmp_path / "spec")
    cfg = read_checkpoint_config(path)
    assert cfg["speculative"]["algorithm"] == "eagle3" and cfg["speculative"]["draft_vocab_size"] == 48
    loaded = load_model(path)
    assert type(loaded).__name__ == type(model).__name__ and loaded.spec_config == model.spec_config
    a, b = model.state_dict(), loaded.state_dict()
    keys = [k for k, v in a.items() if isinstance(v, torch.Tensor) and not k.endswith("_extra_state")]
    assert any("eagle" in k or "draft" in k for k in keys)
    for k in keys:
        assert torch.equal(a[k], b[k]), k
    base_only = load_model(path, base_only=True)
    assert type(base_only).__name__ == "GPTModel" and _same_weights(base, base_only)
    assert loaded.trained_seq_len is None and "trained_seq_len" not in cfg  # unknown unless a recipe trained it


def test_speculative_checkpoint_keeps_the_draft_training_length(tmp_path):
    """SpeculativeGPT.trained_seq_len is written to nemo_spec_config.json, read back by load_model, kept by a
    re-save; a malformed value is refused naming the field."""
    spec_mod = pytest.importorskip("nemo_spec.speculative")
    torch.manual_seed(2)
    model = spec_mod.SpeculativeTransform(algorithm="eagle3", draft_vocab_size=48)(build_gpt(tiny_llama(num_layers=2)))
    model.trained_seq_len = 96
    path = save_checkpoint(model, tmp_path / "spec")
    assert read_checkpoint_config(path)["trained_seq_len"] == 96
    loaded = load_model(path)
    assert loaded.trained_seq_len == 96
    again = save_checkpoint(loaded, tmp_path / "again")
    assert load_model(again).trained_seq_len == 96
    cfg_file = path / ckpt_megatron.CONFIG_NAME
    for bad in (0, "96", 1.5, True):
        meta = json.loads(cfg_file.read_text())
        meta["trained_seq_len"] = bad
        cfg_file.write_text(json.dumps(meta))
        with pytest.raises(CheckpointConfigError, match="trained_seq_len"):
            load_model(path)


# ----------------------------------------------------------------------------------------------------------------
# resharding (torchrun, 2 processes on gloo)
# ----------------------------------------------------------------------------------------------------------------

def test_tp1_checkpoint_loads_at_tp2(reshard):
    r = reshard["results"]["tp1_dist@tp2"]
    assert r["tp"] == 2 and r["sd_equal"] and r["err"] < TOL, r


def test_tp2_checkpoint_loads_at_tp2(reshard):
    r = reshard["results"]["tp2_dist@tp2"]
    assert r["tp"] == 2 and r["sd_equal"] and r["err"] < TOL, r


def test_gpt2_family_reshards_both_ways(reshard):
    r = reshard["results"]["gpt2_tp1_dist@tp2"]
    assert r["tp"] == 2 and r["sd_equal"] and r["err"] < TOL, r
    ref = reshard["gpt2"]
    model = load_model(reshard["work"] / "gpt2_tp2_dist")
    assert model.share_embeddings_and_output_weights
    sd = tensor_sd(model)
    assert set(sd) == set(ref["state_dict"]) and all(torch.equal(sd[k], v) for k, v in ref["state_dict"].items())
    assert (_logits(model, ref["input_ids"]) - ref["logits"]).abs().max().item() < TOL


def test_tp2_checkpoint_loads_at_tp1(reshard):
    path = reshard["work"] / "tp2_dist"
    assert read_checkpoint_config(path)["tp_size_saved"] == 2
    model = load_model(path)
    sd = tensor_sd(model)
    ref = reshard["state_dict"]
    assert set(sd) == set(ref) and all(torch.equal(sd[k], ref[k]) for k in ref)
    err = (_logits(model, reshard["input_ids"]) - reshard["logits"]).abs().max().item()
    assert err < TOL


# ----------------------------------------------------------------------------------------------------------------
# atomic writes
# ----------------------------------------------------------------------------------------------------------------

def test_writer_failure_leaves_nothing(tmp_path, monkeypatch):
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    def boom(*a, **k):
        raise OSError("disk full (injected)")

    # the forked writer processes inherit the patch; megatron reports their errors back to the saving rank
    monkeypatch.setattr(filesystem_async, "_write_item", boom)
    model = build_gpt(tiny_llama())
    target = tmp_path / "ckpt"
    with pytest.raises(CheckpointError, match="saving .*ckpt failed") as e:
        save_checkpoint(model, target)
    assert "injected" in str(getattr(e.value.__cause__, "failures", e.value.__cause__))
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(CheckpointError, match="does not exist"):
        load_model(target)


def test_failure_after_tensors_leaves_nothing(tmp_path, monkeypatch):
    def boom(tmp, cfg):
        raise RuntimeError("config write failed (injected)")

    monkeypatch.setattr(ckpt_megatron, "_write_config", boom)
    with pytest.raises(CheckpointError, match="saving .*ckpt failed.*injected"):
        save_checkpoint(build_gpt(tiny_llama()), tmp_path / "ckpt")
    assert list(tmp_path.iterdir()) == []


def test_killed_before_rename_is_never_a_checkpoint(tmp_path, monkeypatch):
    """The on-disk state of a save killed after its last write but before the rename."""
    monkeypatch.setattr(ckpt_megatron, "_commit", lambda tmp, target, overwrite: None)
    target = tmp_path / "ckpt"
    save_checkpoint(build_gpt(tiny_llama()), target)
    monkeypatch.undo()
    partial = tmp_path / ("ckpt" + ckpt_megatron.TEMP_SUFFIX)
    assert partial.is_dir() and (partial / "nemo_spec_config.json").is_file() and not target.exists()
    with pytest.raises(CheckpointError, match="does not exist"):
        load_model(target)
    with pytest.raises(CheckpointError, match="unfinished"):
        load_model(partial)
    # a later save removes the stale temp dir and produces a valid checkpoint
    (partial / "junk.bin").write_bytes(b"x")
    torch.manual_seed(9)
    model = build_gpt(tiny_llama())
    save_checkpoint(model, target)
    assert not partial.exists() and not (target / "junk.bin").exists()
    assert _same_weights(model, load_model(target))
    # an overwrite killed between moving the old checkpoint aside and removing it leaves the old one under a
    # displaced name: that is not a checkpoint either
    import shutil

    displaced = tmp_path / ".ckpt.old-0123abcd"
    shutil.copytree(target, displaced)
    with pytest.raises(CheckpointError, match="unfinished"):
        load_model(displaced)


def test_incomplete_torch_dist_dir_is_rejected(llama_ckpt, tmp_path):
    path, _ = llama_ckpt
    no_meta = tmp_path / "no_meta"
    shutil.copytree(path, no_meta)
    (no_meta / "metadata.json").unlink()
    with pytest.raises(CheckpointError, match="incomplete.*metadata.json"):
        load_model(no_meta)
    no_cfg = tmp_path / "no_cfg"
    shutil.copytree(path, no_cfg)
    (no_cfg / "nemo_spec_config.json").unlink()
    with pytest.raises(CheckpointError, match="without a model config"):
        load_model(no_cfg)


def test_existing_target_replaced_only_with_overwrite(tmp_path):
    torch.manual_seed(10)
    first = build_gpt(tiny_llama())
    target = save_checkpoint(first, tmp_path / "ckpt")
    torch.manual_seed(11)
    second = build_gpt(tiny_llama())
    with pytest.raises(CheckpointError, match="already exists.*overwrite=True"):
        save_checkpoint(second, target)
    assert _same_weights(first, load_model(target))
    save_checkpoint(second, target, overwrite=True)
    assert _same_weights(second, load_model(target))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "notes.txt").write_text("keep me")
    with pytest.raises(CheckpointError, match="not a checkpoint; refusing to replace it"):
        save_checkpoint(second, precious, overwrite=True)
    assert (precious / "notes.txt").read_text() == "keep me"
    with pytest.raises(CheckpointError, match="JSON-serialisable"):
        save_checkpoint(second, tmp_path / "x", extra={"bad": object()})
    assert not (tmp_path / "x").exists()


# ----------------------------------------------------------------------------------------------------------------
# errors, raised before loading weights
# ----------------------------------------------------------------------------------------------------------------

def _edited_copy(src, dst, **model_fields):
    shutil.copytree(src, dst)
    f = dst / "nemo_spec_config.json"
    cfg = json.loads(f.read_text())
    cfg["model"].update(model_fields)
    f.write_text(json.dumps(cfg))
    return dst


def test_missing_and_unrecognised_dirs(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_model(tmp_path / "nope")
    (tmp_path / "file.txt").write_text("x")
    with pytest.raises(CheckpointError, match="not a directory"):
        load_model(tmp_path / "file.txt")
    odd = tmp_path / "odd"
    odd.mkdir()
    (odd / "weights.bin").write_bytes(b"\0")
    with pytest.raises(CheckpointError, match="unrecognised.*nemo_spec_config.json.*latest_checkpointed_iteration"
                                              ".*config.json.*weights.bin"):
        load_model(odd)
    (odd / "config.json").write_text(json.dumps({"hidden_size": 8}))
    with pytest.raises(CheckpointError, match="config.json has neither an 'architectures' nor a 'model_type'"):
        load_model(odd)


def test_shape_mismatch_names_tensor_and_shapes(llama_ckpt, tmp_path):
    path, _ = llama_ckpt
    bad = _edited_copy(path, tmp_path / "bad", ffn_hidden_size=64)
    with pytest.raises(CheckpointError, match=r"linear_fc\d\.weight.*\(2, 256, 64\)|linear_fc\d\.weight.*\(2, 64, 128\)"):
        load_model(bad)


def test_unsupported_architecture_in_config(llama_ckpt, tmp_path):
    path, _ = llama_ckpt
    bad = _edited_copy(path, tmp_path / "bad", activation="relu6")
    with pytest.raises(CheckpointConfigError, match="nemo_spec_config.json.*activation"):
        load_model(bad)
    bad2 = _edited_copy(path, tmp_path / "bad2", num_experts=8)
    with pytest.raises(CheckpointConfigError, match="nemo_spec_config.json.*unknown ModelConfig field.*num_experts"):
        load_model(bad2)


def test_tp_that_does_not_divide_is_rejected_before_loading(llama_ckpt, tmp_path):
    path, _ = llama_ckpt
    with pytest.raises(CheckpointConfigError, match="nemo_spec_config.json.*num_query_groups=2") as e:
        load_model(path, tp_size=4)
    assert isinstance(e.value, ConfigError)
    odd_vocab = _edited_copy(path, tmp_path / "vocab", vocab_size=97)
    with pytest.raises(ConfigError, match="nemo_spec_config.json.*vocab_size=97"):
        load_model(odd_vocab, tp_size=2)
    with pytest.raises(CheckpointConfigError, match="cannot load at tp_size=2.*world size 1"):
        load_model(path, tp_size=2)  # divisible, but this single process cannot host two TP ranks


def test_hugging_face_dirs_dispatch_to_hf(tmp_path):
    hf = pytest.importorskip("nemo_spec.checkpoint.hf")
    torch.manual_seed(12)
    model = perturb_(build_gpt(tiny_llama()), seed=13)
    out = hf.export_hf(model, tmp_path / "hf")
    assert detect_format(out) == "hf"
    assert read_checkpoint_config(out)["model"]["hidden_size"] == 64
    loaded = load_model(out)
    sd, ref = tensor_sd(loaded), tensor_sd(model)
    assert set(sd) == set(ref) and all(torch.allclose(sd[k], ref[k]) for k in ref)
    cfg = json.loads((out / "config.json").read_text())
    cfg["architectures"] = ["BertForMaskedLM"]
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="config.json.*BertForMaskedLM"):
        load_model(out)


@pytest.mark.parametrize("damage", ["delete_shard", "truncate_shard", "delete_common", "truncate_common"])
def test_a_damaged_checkpoint_is_a_checkpoint_error_naming_its_files(tmp_path, damage, capsys):
    """A deleted or truncated shard / common.pt raised torch's CheckpointException (a BaseException, so it escaped
    every script's one-line user-error report), an AttributeError or a RuntimeError from inside megatron (found by
    review). Now a CheckpointError naming the missing file, or the files one of which is damaged; export.py
    exits 2 with one line."""
    from nemo_spec.checkpoint import load_model, save_checkpoint
    from nemo_spec.export.cli import main as export_main

    torch.manual_seed(0)
    ck = save_checkpoint(build_gpt(tiny_llama()), tmp_path / "ck")
    f = next(p for p in ck.iterdir() if p.suffix == ".distcp") if damage.endswith("shard") else ck / "common.pt"
    if damage.startswith("delete"):
        f.unlink()
    else:
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with pytest.raises(CheckpointError, match=("files missing" if damage.startswith("delete") else "damaged file")):
        load_model(ck)
    try:
        load_model(ck)
    except CheckpointError as e:
        assert f.name in str(e)
    assert export_main(["--checkpoint", str(ck), "--export_dir", str(tmp_path / "x")]) == 2
    assert capsys.readouterr().err.startswith("error: ")


@pytest.mark.parametrize("field,value", [("num_query_groups", 0), ("head_dim", 0), ("head_dim", "16"),
                                         ("rope_theta", "abc"), ("rope_scaling", ["linear"]),
                                         ("sliding_window_layers", ["a"]), ("norm_eps", "x")])
def test_a_model_field_of_the_wrong_kind_is_a_config_error_naming_it(tmp_path, field, value):
    """nemo_spec_config.json model fields the config did not check raised ZeroDivisionError / TypeError /
    AttributeError / ValueError from inside megatron or the RoPE code, or (norm_eps) loaded silently (found by
    review); now the checkpoint's config error names the field."""
    from nemo_spec.checkpoint import load_model, save_checkpoint

    torch.manual_seed(0)
    ck = save_checkpoint(build_gpt(tiny_llama()), tmp_path / "ck")
    path = ck / "nemo_spec_config.json"
    cfg = json.loads(path.read_text())
    cfg["model"][field] = value
    path.write_text(json.dumps(cfg))
    with pytest.raises(CheckpointConfigError, match=field):
        load_model(ck)


@pytest.mark.parametrize("value", ["int8", None, 16])
def test_an_unknown_params_dtype_is_a_config_error(llama_ckpt, tmp_path, value):
    """params_dtype 'int8' (or null, or a number) in nemo_spec_config.json loaded silently as fp32 (found by
    review); now refused naming the field, even when the caller asks for a dtype."""
    path, _ = llama_ckpt
    ck = tmp_path / "ck"
    shutil.copytree(path, ck)
    cfg = json.loads((ck / "nemo_spec_config.json").read_text())
    assert cfg["params_dtype"] == "float32"
    cfg["params_dtype"] = value
    (ck / "nemo_spec_config.json").write_text(json.dumps(cfg))
    for dtype in (None, torch.float32):
        with pytest.raises(CheckpointConfigError, match=r"nemo_spec_config.json: field 'params_dtype' must be one"):
            load_model(ck, dtype=dtype)


def test_a_script_without_a_main_guard_is_told_why_its_save_failed(tmp_path):
    """megatron-core's writer starts a helper with multiprocessing 'spawn', which runs an unguarded calling script
    again (here: its second parallel.initialize finds the port taken); the save failed as a bare "EOFError: "."""
    import subprocess
    import sys

    from tests.helpers import script_env

    script = tmp_path / "save_tiny.py"
    script.write_text(
        "from nemo_spec import parallel\nfrom nemo_spec.checkpoint import save_checkpoint\n"
        "from nemo_spec.config import ModelConfig\nfrom nemo_spec.models import build_gpt\n"
        "parallel.initialize(tensor_parallel_size=1)\n"
        "cfg = ModelConfig(vocab_size=128, hidden_size=64, num_layers=2, num_attention_heads=4, num_query_groups=2,"
        " ffn_hidden_size=128)\n"
        f"save_checkpoint(build_gpt(cfg), {str(tmp_path / 'ckpt')!r})\n")
    p = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=script_env(), capture_output=True, text=True,
                       timeout=300)  # its own process group, not this one's port
    assert p.returncode != 0
    assert "could not start its helper process" in p.stderr and 'if __name__ == "__main__":' in p.stderr
    assert not (tmp_path / "ckpt").exists()
