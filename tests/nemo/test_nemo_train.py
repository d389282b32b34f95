"""NeMo 2's own training loop: llm.train(..., model_transform=SpeculativeTransform(...)) on a tiny Llama-style
llm.LlamaModel, on CPU. Runs NeMo's real classes (MegatronStrategy, MegatronParallel, megatron DDP + optimizer,
NeMoLogger / ModelCheckpoint, AutoResume); the README's "NeMo 2" snippet is what runs here."""
from __future__ import annotations

import re
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch

from nemo_spec.models import gpt_forward, unwrap_speculative
from nemo_spec.models.foreign import foreign_forward, is_project_spec, to_project_spec

README = Path(__file__).resolve().parents[2] / "README.md"
SEQ, STEPS = 32, 4


def readme_snippet() -> str:
    """The python block under README's "NeMo 2" heading that starts with the llm.train import."""
    text = README.read_text()
    sec = text[text.index("## NeMo 2"):]
    block = re.search(r"```python\n(from nemo\.collections import llm\n.*?)```", sec, re.S)
    assert block, "README's NeMo 2 section has no llm.train snippet"
    return block.group(1)


def train_readme_snippet_with(tmp: Path, max_steps: int, transform: str):
    """Run README's llm.train snippet with its SpeculativeTransform(...) replaced by ``transform`` (source text);
    returns (namespace, Record callback) of :func:`build`."""
    ns, rec = build(tmp, max_steps)
    eagle = "SpeculativeTransform(num_eagle_layers=1, num_medusa_heads=0)"
    code = readme_snippet()
    assert eagle in code
    exec(compile(code.replace(eagle, transform), "README snippet", "exec"), ns)
    return ns, rec


class Record(pl.Callback):
    """What the run did: draft/base tensors at train start, the optimizer's parameters, losses, start step."""

    def __init__(self) -> None:
        self.losses = []

    def on_train_start(self, trainer, pl_module):
        spec = unwrap_speculative(pl_module)
        self.spec = spec
        self.start_step = trainer.global_step
        if spec is None:  # a run without the transform (a base checkpoint for the restore test)
            return
        self.base0 = {k: v.detach().clone() for k, v in spec.gpt.state_dict().items() if torch.is_tensor(v)}
        self.draft0 = {k: v.detach().clone() for k, v in spec.draft.named_parameters()}
        opt = trainer.optimizers[0]
        groups = getattr(opt, "mcore_optimizer", opt).param_groups
        self.opt_params = {id(p) for g in groups for p in g["params"]}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(trainer.callback_metrics["reduced_train_loss"]))


def build(tmp: Path, max_steps: int, resume: bool = False, save_optim_on_train_end: bool = True, model_fn=None):
    """(namespace for the README snippet, Record callback): tiny Llama model (or ``model_fn(tokenizer)``), mock data,
    CPU trainer."""
    from nemo import lightning as nl
    from nemo.collections import llm
    from nemo.collections.common.tokenizers.huggingface.auto_tokenizer import AutoTokenizer
    from megatron.core.optimizer import OptimizerConfig
    from nemo.collections.llm.gpt.model.llama import Llama3Config

    import cpu_shims

    tok = AutoTokenizer(str(tokenizer_dir(tmp)))
    config = Llama3Config(
        num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, num_query_groups=2,
        kv_channels=16, seq_length=SEQ, init_method_std=0.05, make_vocab_size_divisible_by=64,
        share_embeddings_and_output_weights=False, bf16=False, params_dtype=torch.float32,
        use_cpu_initialization=True, attention_dropout=0.0, hidden_dropout=0.0,
        # fused kernels need Transformer Engine / CUDA
        apply_rope_fusion=False, bias_activation_fusion=False, masked_softmax_fusion=False,
        persist_layer_norm=False, bias_dropout_fusion=False, gradient_accumulation_fusion=False,
        cross_entropy_loss_fusion=False)
    record = Record()
    trainer = nl.Trainer(
        accelerator="cpu", devices=1, max_steps=max_steps, log_every_n_steps=1, limit_val_batches=0,
        num_sanity_val_steps=0, val_check_interval=max_steps, callbacks=[record], logger=False,
        strategy=nl.MegatronStrategy(tensor_model_parallel_size=1, ckpt_async_save=False),
        plugins=nl.MegatronMixedPrecision(precision="32"))
    ns = dict(
        model=model_fn(tok) if model_fn is not None else llm.LlamaModel(config, tokenizer=tok),
        data=cpu_shims.mock_data(seq_length=SEQ, tokenizer=tok, micro_batch_size=2, global_batch_size=2,
                                 num_workers=0, pin_memory=False),
        trainer=trainer,
        # clip_grad=0: megatron/core/optimizer/clip_grads.py:167 asserts CUDA gradients when clipping
        optim=nl.MegatronOptimizerModule(config=OptimizerConfig(optimizer="adam", lr=5e-3, clip_grad=0.0,
                                                                use_distributed_optimizer=False)),
        log=nl.NeMoLogger(log_dir=str(tmp / "logs"), name="draft", use_datetime_version=False,
                          ckpt=nl.ModelCheckpoint(save_last=True, every_n_train_steps=STEPS, save_top_k=1,
                                                  monitor="reduced_train_loss",
                                                  save_optim_on_train_end=save_optim_on_train_end)),
        resume=nl.AutoResume(resume_if_exists=True, resume_ignore_no_checkpoint=False) if resume else None,
    )
    return ns, record


def tokenizer_dir(tmp: Path) -> Path:
    d = tmp / "tokenizer"
    if not d.is_dir():
        from tokenizers import Tokenizer, models, pre_tokenizers, trainers
        from transformers import PreTrainedTokenizerFast

        tk = Tokenizer(models.BPE(unk_token="<unk>"))
        tk.pre_tokenizer = pre_tokenizers.ByteLevel()
        tk.train_from_iterator(["def f(x):\n    return x + 1\n" * 20, "import os\nprint(os.getcwd())\n" * 20],
                               trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>", "<s>", "</s>"]))
        PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>",
                                unk_token="<unk>").save_pretrained(str(d))
    return d


def run_snippet(ns: dict) -> None:
    code = readme_snippet()
    if ns.get("resume") is not None:  # the resumed run: the same call with NeMo's AutoResume
        code = code.replace("model_transform=", "resume=resume, model_transform=")
    exec(compile(code, "README.md (NeMo 2 snippet)", "exec"), ns)


@pytest.fixture(scope="module")
def first_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("nemo_train")
    ns, record = build(tmp, STEPS)
    run_snippet(ns)
    return tmp, ns, record


def test_llm_train_trains_exactly_the_draft(first_run):
    _, ns, rec = first_run
    spec = rec.spec
    assert spec is unwrap_speculative(ns["model"])
    assert rec.opt_params == {id(p) for p in spec.draft_parameters()}  # the optimizer holds exactly the draft
    for k, v in spec.gpt.state_dict().items():
        if torch.is_tensor(v):
            assert torch.equal(v, rec.base0[k]), f"base tensor {k} changed"
    unchanged = [k for k, v in spec.draft.named_parameters() if torch.equal(v, rec.draft0[k])]
    assert not unchanged, f"draft tensors never trained: {unchanged}"
    assert len(rec.losses) == STEPS and rec.losses[-1] < rec.losses[0], rec.losses


def test_base_hidden_states_are_nemos_own_forward(first_run):
    _, ns, rec = first_run
    spec = rec.spec
    gpt = spec.gpt
    assert not is_project_spec(gpt)  # NeMo's MCoreGPTModel with megatron's local spec (no TE here)
    ids = torch.randint(0, 64, (2, SEQ), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(SEQ)[None].expand(2, SEQ)
    mask = torch.ones(SEQ, SEQ, dtype=torch.bool).triu(1)[None, None]
    with torch.no_grad():
        own = gpt(ids, pos, mask)  # NeMo's MCoreGPTModel forward (RoPE inside, megatron masks)
        out = gpt_forward(gpt, ids, aux_layers=spec.aux_layers)
    assert torch.equal(out.logits, own)


def test_checkpoint_resumes(first_run):
    tmp, ns, rec = first_run
    ns2, rec2 = build(tmp, STEPS + 2, resume=True)
    run_snippet(ns2)
    assert rec2.start_step == STEPS
    for k, v in rec2.draft0.items():  # restored from NeMo's checkpoint: the first run's final draft
        assert torch.equal(v, dict(rec.spec.draft.named_parameters())[k].detach()), k
    for k, v in rec2.base0.items():
        assert torch.equal(v, rec.base0[k]), k
    assert len(rec2.losses) == 2
    assert any(not torch.equal(v, rec2.draft0[k]) for k, v in rec2.spec.draft.named_parameters())


def test_nemo_checkpoint_loads_in_load_model_with_exact_logits(first_run):
    from nemo_spec.checkpoint import load_model
    from nemo_spec.checkpoint.megatron import find_tokenizer_dir

    tmp, ns, rec = first_run
    last = sorted((tmp / "logs" / "draft" / "checkpoints").glob("*-last"))
    assert last, list((tmp / "logs").rglob("*"))
    base = load_model(last[-1], base_only=True)
    assert is_project_spec(base) and unwrap_speculative(base) is None
    ids = torch.randint(0, 64, (1, SEQ), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = foreign_forward(rec.spec.gpt, ids).logits
        got = gpt_forward(base, ids).logits
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), (got - want).abs().max()
    assert find_tokenizer_dir(last[-1]) is not None


def test_the_trained_draft_loads_back_from_nemos_checkpoint(first_run, tmp_path):
    """The draft trained by llm.train is recovered from NeMo's checkpoint alone (the settings the integration
    records in its common state, the tensors NeMo saved as module.eagle_module.*): it was lost with the job."""
    from nemo_spec.checkpoint import load_model
    from nemo_spec.inference import SamplingParams, generate

    tmp, _, rec = first_run
    spec = load_model(_last_checkpoint(tmp))
    assert unwrap_speculative(spec) is spec and spec.algorithm == rec.spec.algorithm == "eagle3"
    assert spec.spec_config.to_dict() == rec.spec.spec_config.to_dict()
    want = {k: v for k, v in rec.spec.draft.state_dict().items() if torch.is_tensor(v)}
    got = spec.draft.state_dict()
    assert want.keys() == {k for k, v in got.items() if torch.is_tensor(v)}
    assert all(torch.equal(got[k], v) for k, v in want.items())
    params = SamplingParams(temperature=0.0, max_new_tokens=10)
    prompt = [[5, 9, 17, 3, 22, 8]]
    assert generate(spec, prompt, params, method="eagle")[0].tokens == generate(spec, prompt, params)[0].tokens
    from nemo_spec.export import export_checkpoint  # scripts/export.py --checkpoint <NeMo checkpoint>

    out = export_checkpoint(_last_checkpoint(tmp), tmp_path / "export", dtype="fp32", verify=True)
    assert (out / "draft" / "vllm" / "config.json").is_file() and (out / "base" / "config.json").is_file()
    out = export_checkpoint(_last_checkpoint(tmp), tmp_path / "named", fmt="eagle3", dtype="fp32", target="vllm")
    assert (out / "draft" / "config.json").is_file()  # --format eagle3 said "has no draft"


def test_the_draft_is_recorded_in_weights_only_checkpoints(tmp_path):
    """NeMo's ModelCheckpoint saves weights only at the end of training unless save_optim_on_train_end (its
    default is False), and Lightning skips callbacks' on_save_checkpoint for such saves: the record must still be
    there, or the default run's final checkpoint loads without its draft."""
    from nemo_spec.checkpoint import load_model

    ns, rec = build(tmp_path, STEPS, save_optim_on_train_end=False)
    run_snippet(ns)
    spec = load_model(_last_checkpoint(tmp_path))
    assert unwrap_speculative(spec) is spec and spec.algorithm == "eagle3"
    assert all(torch.equal(spec.draft.state_dict()[k], v) for k, v in rec.spec.draft.state_dict().items()
               if torch.is_tensor(v))


def test_a_second_llm_train_with_another_draft_on_the_same_model_is_refused(tmp_path):
    """llm.train again on the same model object with a different transform kept training the first draft silently
    (found by review); the transform now re-applies to the module: the same draft continues, another is refused."""
    from nemo_spec.config import ConfigError

    ns, rec = train_readme_snippet_with(tmp_path / "a", 1, "SpeculativeTransform(num_eagle_layers=1, num_medusa_heads=0)")
    ns2, _ = build(tmp_path / "b", 1)
    ns2["model"] = ns["model"]
    code = readme_snippet().replace("SpeculativeTransform(num_eagle_layers=1, num_medusa_heads=0)",
                                    "SpeculativeTransform(algorithm='medusa', num_medusa_heads=2)")
    with pytest.raises(ConfigError, match="already carries a eagle3 draft; refusing to stack medusa"):
        exec(compile(code, "README snippet", "exec"), ns2)


def test_trained_draft_exports_and_generates_losslessly(first_run, tmp_path):
    from nemo_spec.checkpoint import load_model
    from nemo_spec.export import export_model
    from nemo_spec.inference import SamplingParams, generate

    _, ns, rec = first_run
    model = to_project_spec(rec.spec)
    params = SamplingParams(temperature=0.0, max_new_tokens=12)
    prompt = [[5, 9, 17, 3, 22, 8]]
    ar = generate(model, prompt, params, method="ar")[0].tokens
    eagle = generate(model, prompt, params, method="eagle")[0].tokens
    assert eagle == ar and len(ar) == 12
    out = export_model(model, tmp_path / "export", dtype="float32")
    base = load_model(out / "base")
    assert generate(base, prompt, params, method="ar")[0].tokens == ar
    assert (out / "draft").is_dir() or any(out.glob("*eagle*")), sorted(p.name for p in out.iterdir())


def test_gpt_speculate_takes_a_nemo_checkpoint(first_run, tmp_path):
    """The seed usage: scripts/gpt_speculate.py --model_path <NeMo 2 checkpoint> (no NeMo import needed)."""
    import subprocess
    import sys

    from nemo_spec.checkpoint import load_model

    tmp, _, rec = first_run
    last = sorted((tmp / "logs" / "draft" / "checkpoints").glob("*-last"))[-1]
    script = Path(__file__).resolve().parents[2] / "scripts" / "gpt_speculate.py"
    import os

    # a fresh process, as a user runs it (Lightning left this process's distributed variables set)
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                        "GROUP_RANK", "NODE_RANK")}
    r = subprocess.run([sys.executable, str(script), "--model_path", str(last), "--export_dir",
                        str(tmp_path / "spec"), "--num_eagle_layers", "1"], capture_output=True, text=True,
                       timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    spec = load_model(tmp_path / "spec")
    assert unwrap_speculative(spec) is spec and spec.algorithm == "eagle3"
    ids = torch.randint(0, 64, (1, SEQ), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = foreign_forward(rec.spec.gpt, ids).logits
        got = gpt_forward(spec.gpt, ids).logits
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5)
    # the checkpoint carries the NeMo-trained eagle3 draft: another draft goes onto its base (it was refused)
    r = subprocess.run([sys.executable, str(script), "--model_path", str(last), "--export_dir",
                        str(tmp_path / "medusa"), "--algorithm", "medusa", "--num_medusa_heads", "2"],
                       capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "is not carried over" in r.stderr
    assert load_model(tmp_path / "medusa").algorithm == "medusa"


def test_dflash_q_k_norm_gradients_are_summed_in_nemos_finalize(tmp_path, monkeypatch):
    """NeMo finalises gradients through ``optim.finalize_model_grads`` (called via the config's
    ``finalize_model_grads_func``), where megatron sums q/k-norm gradients over TP only if the LightningModule's
    config (the base's: no q/k norms here) says ``qk_layernorm``. For a DFlash draft (q/k-normed layers) the
    integration wraps it: every optimizer step of NeMo's own loop then runs nemo_spec's TP sum on the draft
    (a no-op at TP=1; the TP=2 arithmetic is checked in tests/dist_scripts/spec_tp2.py)."""
    from nemo_spec import parallel

    calls = []
    orig = parallel.all_reduce_tp_partial_grads
    monkeypatch.setattr(parallel, "all_reduce_tp_partial_grads", lambda m: calls.append(m) or orig(m))
    ns, rec = train_readme_snippet_with(tmp_path, 2, "SpeculativeTransform(algorithm='dflash', num_layers=1, "
                                                     "block_size=4, target_layer_ids=[0], mask_token_id=0)")
    assert not ns["model"].config.qk_layernorm
    assert len(calls) == 2 and all(m is rec.spec and m.algorithm == "dflash" for m in calls), calls
    assert parallel.tp_partial_grad_params(rec.spec) and all(l == l for l in rec.losses)


def test_peagle_depth_warmup_follows_nemos_step(tmp_path, monkeypatch):
    """In NeMo's own loop the integration's callback tells the draft its optimizer step, so P-EAGLE's
    ``depth_warmup_steps`` applies there as in our recipe: step 0 trains depth 0 only, step 1 all depths."""
    import nemo_spec.speculative.peagle as peagle

    seen = []
    orig = peagle.peagle_losses

    def spy(model, *a, **k):
        res = orig(model, *a, **k)
        if model.training:
            seen.append((model.train_step, len(res["step_acc"])))
        return res

    monkeypatch.setattr(peagle, "peagle_losses", spy)
    _, rec = train_readme_snippet_with(tmp_path, 2, "SpeculativeTransform(algorithm='peagle', num_eagle_layers=1, "
                                                    "parallel_depth=3, mask_token_id=0, depth_warmup_steps=1)")
    assert rec.spec.algorithm == "peagle"
    assert sorted(set(seen)) == [(0, 1), (1, 3)], seen
    assert all(l == l for l in rec.losses)


def _last_checkpoint(tmp: Path) -> Path:
    last = sorted((tmp / "logs" / "draft" / "checkpoints").glob("*-last"))
    assert last, list((tmp / "logs").rglob("*"))
    return last[-1]


def test_train_a_draft_on_a_restored_base_checkpoint(tmp_path):
    """NeMo starts from a pretrained or llm.import_ckpt-ed model with AutoResume(restore_config=RestoreConfig(path))
    (the finetune recipes do): MegatronStrategy.selective_restore loads strictly, and the base's checkpoint holds no
    draft, so it failed before the first step ("module.eagle_module.fc.weight from model not in state dict").
    The base is restored exactly, the draft keeps its initialisation and trains; a checkpoint that does hold the
    draft still restores it (test_checkpoint_resumes)."""
    from nemo import lightning as nl
    from nemo.collections import llm

    ns, rec = build(tmp_path / "base", STEPS)  # a base trained (LM steps) and saved by NeMo, no draft
    llm.train(model=ns["model"], data=ns["data"], trainer=ns["trainer"], optim=ns["optim"], log=ns["log"],
              tokenizer="data")
    assert rec.spec is None
    gpt = ns["model"].module
    while hasattr(gpt, "module"):  # megatron DDP (and Float16Module) around NeMo's MCoreGPTModel
        gpt = gpt.module
    base = {k: v.detach().clone() for k, v in gpt.state_dict().items() if torch.is_tensor(v)}
    ns2, rec2 = build(tmp_path / "draft", 2)
    ns2["resume"] = nl.AutoResume(restore_config=nl.RestoreConfig(path=str(_last_checkpoint(tmp_path / "base"))))
    run_snippet(ns2)
    assert rec2.spec is unwrap_speculative(ns2["model"]) and rec2.start_step == 0
    assert rec2.base0.keys() == base.keys()
    assert all(torch.equal(rec2.base0[k], base[k]) for k in base), "the base was not restored"
    assert rec2.opt_params == {id(p) for p in rec2.spec.draft_parameters()}
    assert any(not torch.equal(v, rec2.draft0[k]) for k, v in rec2.spec.draft.named_parameters())
    assert len(rec2.losses) == 2 and all(l == l for l in rec2.losses)


def test_one_transform_object_serves_two_llm_train_runs(tmp_path):
    """A transform object reused for a second llm.train (a notebook re-run, a second model) used to skip the second
    model (its "applied" flag was the transform's, not the model's): that run trained every base parameter with the
    LM loss, silently."""
    from nemo_spec.integrations.nemo import SpeculativeTransform

    t = SpeculativeTransform(num_eagle_layers=1, num_medusa_heads=0)
    runs = []
    for i in range(2):
        ns, rec = build(tmp_path / f"run{i}", 1)
        ns["T"] = t
        code = readme_snippet().replace("SpeculativeTransform(num_eagle_layers=1, num_medusa_heads=0)", "T")
        exec(compile(code, "README snippet", "exec"), ns)
        runs.append((ns, rec))
    assert runs[0][1].spec is not runs[1][1].spec
    for ns, rec in runs:
        assert rec.spec is not None and rec.spec is unwrap_speculative(ns["model"])
        assert rec.opt_params == {id(p) for p in rec.spec.draft_parameters()}


@pytest.mark.parametrize("field,value", [("window_size", [8, 0]), ("softmax_scale", 0.5), ("no_rope_freq", [0, 1]),
                                         ("softmax_type", "off-by-one"), ("attention_output_gate", True),
                                         ("glu_linear_offset", 1.0), ("qk_l2_norm", True),
                                         ("layernorm_zero_centered_gamma", True)])
def test_nemo_checkpoint_attention_settings_the_spec_lacks_are_refused(first_run, tmp_path, field, value):
    """model.yaml settings megatron applies but the project spec does not have (MistralConfig7B's window_size, a
    softmax scale, layers without RoPE, another softmax, a gated attention output, an offset GLU, L2 q/k norms (NeMo
    builds the Transformer-Engine spec, which applies them), zero-centred norms) loaded as a different model without
    a word."""
    import shutil

    import yaml

    from nemo_spec.checkpoint import load_model
    from nemo_spec.checkpoint.megatron import CheckpointConfigError

    tmp, _, _ = first_run
    ckpt = Path(shutil.copytree(_last_checkpoint(tmp), tmp_path / "ckpt"))
    f = ckpt / "context" / "model.yaml"
    doc = yaml.safe_load(f.read_text())
    doc["config"][field] = value
    f.write_text(yaml.safe_dump(doc))
    with pytest.raises(CheckpointConfigError, match=rf"config\.{field}="):
        load_model(ckpt)


@pytest.mark.parametrize("family", ["qwen3", "qwen2"])
def test_nemo_qwen_checkpoint_loads_with_exact_logits(tmp_path, family):
    """NeMo's own llm.Qwen3Model (Qwen3Config: qk_layernorm=True, kv_channels apart from hidden/heads, RMSNorm
    eps 1e-6, rotary_base 1e6, no qkv bias, tied embeddings) and llm.Qwen2Model (add_qkv_bias=True, untied),
    trained a few steps and saved by llm.train, load in load_model with NeMo's own logits. Qwen3 was refused
    ("QK layer norm (config.qk_layernorm=True)")."""
    from nemo.collections import llm

    from nemo_spec.checkpoint import load_model

    cls, model_cls = {"qwen3": (llm.Qwen3Config, llm.Qwen3Model), "qwen2": (llm.Qwen2Config, llm.Qwen2Model)}[family]
    config = cls(
        num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, num_query_groups=2,
        kv_channels=16 if family == "qwen3" else None, seq_length=SEQ, init_method_std=0.05,
        vocab_size=128, share_embeddings_and_output_weights=family == "qwen3", bf16=False,
        params_dtype=torch.float32, use_cpu_initialization=True, attention_dropout=0.0, hidden_dropout=0.0,
        apply_rope_fusion=False, bias_activation_fusion=False, masked_softmax_fusion=False,
        persist_layer_norm=False, bias_dropout_fusion=False, gradient_accumulation_fusion=False,
        cross_entropy_loss_fusion=False)
    assert config.qk_layernorm == (family == "qwen3") and config.add_qkv_bias == (family == "qwen2")
    ns, _ = build(tmp_path, STEPS, model_fn=lambda tok: model_cls(config, tokenizer=tok))
    llm.train(model=ns["model"], data=ns["data"], trainer=ns["trainer"], optim=ns["optim"], log=ns["log"],
              tokenizer="data")
    model = ns["model"]
    gpt = model.module
    while hasattr(gpt, "module"):  # megatron DDP (and Float16Module) around NeMo's MCoreGPTModel
        gpt = gpt.module
    attn = gpt.decoder.layers[0].self_attention
    if family == "qwen3":  # the q/k norms trained away from their initial ones: loading them is checked
        assert not torch.equal(attn.q_layernorm.weight, torch.ones_like(attn.q_layernorm.weight))
    else:
        assert attn.linear_qkv.bias is not None
    from nemo_spec.checkpoint import nemo2

    m = nemo2.read_config(_last_checkpoint(tmp_path))["model"]  # the fields Qwen's NeMo configs set
    assert {k: m[k] for k in ("qk_layernorm", "add_qkv_bias", "head_dim", "rope_theta", "norm_eps", "normalization",
                              "tie_word_embeddings", "add_bias_linear", "activation", "vocab_size")} == dict(
        qk_layernorm=family == "qwen3", add_qkv_bias=family == "qwen2", head_dim=16, rope_theta=1e6, norm_eps=1e-6,
        normalization="RMSNorm", tie_word_embeddings=family == "qwen3", add_bias_linear=False, activation="swiglu",
        vocab_size=128)
    base = load_model(_last_checkpoint(tmp_path), base_only=True)
    assert is_project_spec(base)
    ids = torch.randint(0, 128, (1, SEQ), generator=torch.Generator().manual_seed(1))
    gpt.eval()
    with torch.no_grad():
        want = foreign_forward(gpt, ids).logits  # NeMo's MCoreGPTModel forward
        got = gpt_forward(base, ids).logits
    print(f"{family}: max|diff|={(got - want).abs().max().item():.3g}")
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), (got - want).abs().max()


@pytest.mark.parametrize("family", ["starcoder2", "gpt"])
def test_nemo_fused_bias_gelu_checkpoint_loads_as_the_tanh_gelu(tmp_path, family):
    """NeMo's Starcoder2Config and GPTConfig126M keep activation_func=F.gelu with bias_activation_fusion=True (their
    defaults, left as they are here), so megatron's MLP runs its fused bias-GELU kernel: GELU's tanh approximation
    (megatron/core/fusions/fused_bias_gelu.py:17-19). load_model read such a checkpoint as the exact GELU, a
    different model (NeMo families review: max logit difference 2e-3, 1 in 40 greedy continuations changed)."""
    from nemo.collections import llm

    from nemo_spec.checkpoint import load_model, nemo2

    cls, model_cls = {"starcoder2": (llm.Starcoder2Config, llm.Starcoder2Model),
                      "gpt": (llm.GPTConfig126M, llm.GPTModel)}[family]
    config = cls(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                 num_query_groups=2 if family == "starcoder2" else None, seq_length=SEQ, init_method_std=0.3,
                 vocab_size=128, bf16=False, params_dtype=torch.float32, use_cpu_initialization=True,
                 attention_dropout=0.0, hidden_dropout=0.0, apply_rope_fusion=False, masked_softmax_fusion=False,
                 persist_layer_norm=False, bias_dropout_fusion=False, gradient_accumulation_fusion=False,
                 cross_entropy_loss_fusion=False)
    assert config.activation_func is torch.nn.functional.gelu and config.bias_activation_fusion
    ns, _ = build(tmp_path, STEPS, model_fn=lambda tok: model_cls(config, tokenizer=tok))
    llm.train(model=ns["model"], data=ns["data"], trainer=ns["trainer"], optim=ns["optim"], log=ns["log"],
              tokenizer="data")
    gpt = ns["model"].module
    while hasattr(gpt, "module"):
        gpt = gpt.module
    assert nemo2.read_config(_last_checkpoint(tmp_path))["model"]["activation"] == "gelu"  # tanh, not gelu_exact
    base = load_model(_last_checkpoint(tmp_path), base_only=True)
    ids = torch.randint(0, 128, (2, SEQ), generator=torch.Generator().manual_seed(1))
    gpt.eval()
    with torch.no_grad():
        want = foreign_forward(gpt, ids).logits
        got = gpt_forward(base, ids).logits
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), (got - want).abs().max()
