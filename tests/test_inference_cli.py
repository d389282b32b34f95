"""generate CLI (args/stdin/file prompts, streaming, stats) and the side-by-side benchmark vs transformers."""
import io
import json

import pytest
import torch

from nemo_spec.inference import SamplingError, SamplingParams, generate
from nemo_spec.inference import benchmark as bench
from nemo_spec.inference import cli
from nemo_spec.models import build_gpt
from tests.helpers import timed_rows, tiny_llama

torch.set_num_threads(1)
TEXT = "the cat sat on the mat and the dog sat on the log while the bird sang in the tree " * 4


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A tiny Llama exported as a Hugging Face dir with a small BPE tokenizer (vocab <= model vocab)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders, trainers
    from transformers import PreTrainedTokenizerFast

    from nemo_spec.checkpoint.hf import export_hf

    root = tmp_path_factory.mktemp("gen")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.train_from_iterator([TEXT], trainers.BpeTrainer(vocab_size=80, special_tokens=["<pad>"]))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>")
    fast.save_pretrained(root / "tok")
    torch.manual_seed(0)
    model = build_gpt(tiny_llama()).eval()
    path = export_hf(model, root / "hf", tokenizer_dir=root / "tok")
    torch.manual_seed(1)
    draft = export_hf(build_gpt(tiny_llama(num_layers=1)).eval(), root / "draft", tokenizer_dir=root / "tok")
    return path, draft, fast


def _run(argv, stdin=""):
    out, err = io.StringIO(), io.StringIO()
    rc = cli.main(argv, stdin=io.StringIO(stdin), stdout=out, stderr=err)
    return rc, out.getvalue(), err.getvalue()


def test_cli_streams_arg_prompt_and_matches_api(ckpt):
    from nemo_spec.checkpoint import load_model

    path, _, tok = ckpt
    rc, out, err = _run(["--model", str(path), "the cat sat", "--max-new-tokens", "6", "--ignore-eos"])
    assert rc == 0 and "tau=1.00" in err and "finish=length" in err
    ids = tok.encode("the cat sat", add_special_tokens=False)
    ref = generate(load_model(path), [ids], SamplingParams(max_new_tokens=6), options={"ignore_eos": True})[0]
    assert out == "the cat sat" + tok.decode(ref.tokens) + "\n"
    # an empty prompt starts from BOS, else EOS (it used to be the pad id 0); this tokenizer has neither
    from types import SimpleNamespace as NS

    from nemo_spec.inference.cli import _start_ids

    assert _start_ids(NS(bos_token_id=1, eos_token_id=2)) == [1]
    assert _start_ids(NS(bos_token_id=None, eos_token_id=2)) == [2]
    assert tok.bos_token_id is None and tok.eos_token_id is None
    with pytest.raises(SamplingError, match="empty prompt and the tokenizer has no BOS or EOS token"):
        _run(["--model", str(path), "", "--max-new-tokens", "6", "--ignore-eos"])


def test_cli_stops_at_the_tokenizers_eos_as_the_server_does(ckpt, tmp_path):
    """generate.py stopped only at the model config's end-of-sequence id; a tokenizer whose EOS differs (a chat
    model's end of turn) ran on past it, while the server stops at both (inference/generate.py end_of_sequence_ids)."""
    from transformers import PreTrainedTokenizerFast

    from nemo_spec.checkpoint import load_model

    path, _, tok = ckpt
    ids = tok.encode("the cat sat", add_special_tokens=False)
    free = generate(load_model(path), [ids], SamplingParams(max_new_tokens=8), options={"ignore_eos": True})[0].tokens
    k = next(i for i in range(1, len(free)) if free[i] not in free[:i])
    eos_tok = PreTrainedTokenizerFast(tokenizer_object=tok.backend_tokenizer, pad_token="<pad>",
                                      eos_token=tok.convert_ids_to_tokens(free[k]))
    eos_tok.save_pretrained(tmp_path / "tok")
    rc, out, err = _run(["--model", str(path), "--tokenizer", str(tmp_path / "tok"), "the cat sat",
                         "--max-new-tokens", "8"])
    assert rc == 0 and "finish=stop" in err
    assert out == "the cat sat" + tok.decode(free[:k]) + "\n"
    rc, out, err = _run(["--model", str(path), "--tokenizer", str(tmp_path / "tok"), "the cat sat",
                         "--max-new-tokens", "8", "--ignore-eos"])
    assert rc == 0 and "finish=length" in err


def test_generate_input_types_are_checked():
    """Float or bool token ids were truncated silently, a bare int as stop_token_ids raised a TypeError, an
    ignore_eos of "false" ignored the end of sequence, max_batch=0 ran every row at once."""
    model = build_gpt(tiny_llama()).eval()
    for prompts, match in (([[5.9, 6.2]], "prompts\\[0\\] must hold integer token ids, got 5.9"),
                           ([[True, 6]], "must hold integer token ids, got True")):
        with pytest.raises(SamplingError, match=match):
            generate(model, prompts, SamplingParams(max_new_tokens=2))
    with pytest.raises(SamplingError, match="stop_token_ids must be a list of token ids, got 2"):
        SamplingParams(stop_token_ids=2)
    with pytest.raises(SamplingError, match="stop_token_ids must hold integer token ids, got 2.7"):
        SamplingParams(stop_token_ids=[2.7])
    assert SamplingParams(stop_token_ids=torch.tensor([3, 4]).numpy()).stop_token_ids == (3, 4)
    for opts, match in (({"ignore_eos": "false"}, "'ignore_eos' must be true or false"),
                        ({"max_batch": 0}, "'max_batch' must be an int >= 1, got 0")):
        with pytest.raises(SamplingError, match=match):
            generate(model, [[5, 6]], SamplingParams(max_new_tokens=2), options=opts)


def test_generated_text_continues_the_prompt(ckpt):
    # a SentencePiece (Metaspace) decode drops a text's leading space: an output "▁mat ..." decoded alone read "mat",
    # and the CLI printed "the cat sat on themat"; like transformers' text-generation pipeline (decode(prompt + output)
    # cut after the prompt) and vLLM (a detokenizer primed with the prompt), the text is the prompt's continuation
    from nemo_spec.checkpoint import load_model

    path, _, tok = ckpt
    model = load_model(path)
    sp = SamplingParams(max_new_tokens=6)
    for prompt in ("the cat sat on the", "the dog sat", "while the bird", "the mat and", "sang in the tree"):
        ids = tok.encode(prompt, add_special_tokens=False)
        res = generate(model, [ids], sp, tokenizer=tok, options={"ignore_eos": True})[0]
        if tok.convert_ids_to_tokens(res.tokens)[0].startswith("\u2581"):
            break
    else:
        pytest.fail("no prompt's output starts with a word")
    full = tok.decode(ids + res.tokens)
    assert res.text == full[len(tok.decode(ids)):] and res.text.startswith(" ")
    rc, out, _ = _run(["--model", str(path), prompt, "--max-new-tokens", "6", "--ignore-eos"])  # streamed
    assert rc == 0 and out == prompt + res.text + "\n"
    rc, out, _ = _run(["--model", str(path), prompt, "--max-new-tokens", "6", "--ignore-eos", "--no-stream"])
    assert rc == 0 and out == f"=== [0] ===\n{prompt}{res.text}\n"


def test_cli_stdin_file_methods_and_stats(ckpt, tmp_path):
    path, draft, _ = ckpt
    stats = tmp_path / "stats.json"
    rc, out, err = _run(["--model", str(path), "-", "--method", "draft_model", "--draft-model", str(draft),
                         "--max-new-tokens", "5", "--ignore-eos", "--stats-json", str(stats)],
                        stdin="the dog sat\nthe bird sang\n")
    assert rc == 0 and out.count("=== [") == 2 and err.count("draft_model:") == 2
    rec = json.loads(stats.read_text())
    assert [r["prompt"] for r in rec] == ["the dog sat", "the bird sang"] and all(len(r["tokens"]) == 5 for r in rec)
    pf = tmp_path / "p.jsonl"
    pf.write_text(json.dumps({"prompt": "on the mat"}) + "\n")
    rc, out, err = _run(["--model", str(path), "--prompt-file", str(pf), "--method", "prompt_lookup",
                         "--temperature", "0.8", "--top-p", "0.9", "--seed", "3", "--max-new-tokens", "4",
                         "--ignore-eos"])
    assert rc == 0 and out.startswith("on the mat") and "prompt_lookup:" in err
    # --adaptive: the same greedy tokens, the draft lengths chosen per step recorded
    rc, out, err = _run(["--model", str(path), "-", "--method", "draft_model", "--draft-model", str(draft),
                         "--max-new-tokens", "5", "--ignore-eos", "--stats-json", str(stats), "--adaptive"],
                        stdin="the dog sat\nthe bird sang\n")
    assert rc == 0 and [r["tokens"] for r in json.loads(stats.read_text())] == [r["tokens"] for r in rec]
    assert all("adaptive" in r["stats"]["session"] for r in json.loads(stats.read_text()))
    assert not any("adaptive" in r["stats"]["session"] for r in rec)


def test_cli_errors(ckpt, tmp_path):
    path, _, _ = ckpt
    with pytest.raises(SamplingError, match="no such checkpoint directory"):  # not "no tokenizer found"
        _run(["--model", str(tmp_path / "missing"), "x"])
    with pytest.raises(SamplingError, match="draft-model"):
        _run(["--model", str(path), "x", "--method", "draft_model"])
    with pytest.raises(SamplingError, match="temperature"):
        _run(["--model", str(path), "x", "--temperature", "-1"])
    with pytest.raises(SamplingError, match="no prompts"):
        _run(["--model", str(path)], stdin="")
    # a prompt over the context fails before any prompt generates or is printed (in batches of one, the first
    # one used to be streamed, then prompt 1 failed)
    for argv in (["--max-new-tokens", "4", "--batch-size", "1"],
                 ["--max-new-tokens", "4", "--batch-size", "1", "--no-stream"]):
        out = io.StringIO()
        with pytest.raises(SamplingError, match="prompt 1 has .* tokens, longer than the model context"):
            cli.main(["--model", str(path), "-", *argv], stdin=io.StringIO("the cat sat\n" + TEXT * 8 + "\n"),
                     stdout=out, stderr=io.StringIO())
        assert out.getvalue() == ""
    # ... also for the method's own limits (here a draft model whose context is too short for prompt 1)
    short = tmp_path / "short_draft"
    from nemo_spec.checkpoint.hf import export_hf

    export_hf(build_gpt(tiny_llama(num_layers=1, max_position_embeddings=32)).eval(), short)
    out = io.StringIO()
    with pytest.raises(SamplingError, match="prompt 1: draft model context"):
        cli.main(["--model", str(path), "-", "--method", "draft_model", "--draft-model", str(short),
                  "--batch-size", "1", "--max-new-tokens", "4"],
                 stdin=io.StringIO("the cat sat\n" + "the dog sat on the log " * 8 + "\n"),
                 stdout=out, stderr=io.StringIO())
    assert out.getvalue() == ""
    out = io.StringIO()
    with pytest.raises(SamplingError, match="prompt 0: .* exceeds the model context"):
        cli.main(["--model", str(path), "the cat sat", "--max-new-tokens", "100000"], stdin=io.StringIO(),
                 stdout=out, stderr=io.StringIO())
    assert out.getvalue() == ""


def test_benchmark_cli_errors_before_loading(ckpt, tmp_path, monkeypatch):
    """Bad numbers, paths and prompt files are one-line errors before any checkpoint loads (a malformed JSONL
    prompt line was a raw KeyError / JSONDecodeError, --repeats 0 ran one round, a missing --model said 'no
    tokenizer found', and batch sizes were checked only after the model had loaded)."""
    import nemo_spec.checkpoint

    path, _, _ = ckpt

    def no_load(*a, **k):
        raise AssertionError("a checkpoint was loaded before the arguments were checked")

    monkeypatch.setattr(nemo_spec.checkpoint, "load_model", no_load)
    (tmp_path / "p.jsonl").write_text('the cat\n{"text": "x"}\n')
    (tmp_path / "q.jsonl").write_text('{"prompt": "x"\n')
    (tmp_path / "r.txt").write_bytes(b"\xff\xfe the cat\n")
    base = ["--model", str(path), "--no-hf", "--out-dir", str(tmp_path / "out")]
    for extra, msg in [(["--prompt-file", str(tmp_path / "p.jsonl")], r"p.jsonl:2: expected a JSON object with a 'prompt'"),
                       (["--prompt-file", str(tmp_path / "q.jsonl")], r"q.jsonl:1: expected a JSON object"),
                       (["--prompt-file", str(tmp_path / "r.txt")], "is not UTF-8 text"),
                       (["--prompt-file", str(tmp_path / "none.txt")], "does not exist"),
                       (["--repeats", "0"], "--repeats must be >= 1"),
                       (["--warm-prompts", "-1"], "--warm-prompts must be >= 0"),
                       (["--batch-sizes", "1", "0"], "--batch-sizes must all be >= 1"),
                       (["--chain-lengths", "0"], "--chain-lengths must all be >= 1"),
                       (["--draft-model", str(tmp_path / "missing")], "--draft-model .*missing: no such checkpoint"),
                       (["--extra-models", str(path), str(tmp_path / "gone")], "--extra-models .*gone: no such")]:
        with pytest.raises(SamplingError, match=msg):
            bench.main(base + extra)
    with pytest.raises(SamplingError, match="--model .*missing: no such checkpoint directory"):
        bench.main(["--model", str(tmp_path / "missing")])


def test_benchmark_side_by_side_with_transformers(ckpt, tmp_path):
    from nemo_spec.checkpoint import load_model

    path, draft, tok = ckpt
    model, dmodel = load_model(path), load_model(draft)
    prompts = [tok.encode(t, add_special_tokens=False) for t in ["the cat sat on", "the dog", "in the tree the bird"]]
    res = bench.benchmark(model, prompts, dmodel, batch_sizes=(1, 2), max_new_tokens=6, work_dir=tmp_path,
                          options={"num_draft_tokens": 3}, repeats=1)
    got = {(r["engine"], r["method"], r["batch_size"]) for r in res["rows"]}
    for b in (1, 2):
        assert {("nemo_spec", m, b) for m in ("ar", "prompt_lookup", "draft_model")} <= got
        assert ("transformers", "plain", b) in got
    assert {("transformers", "prompt_lookup", 1), ("transformers", "assistant_model", 1)} <= got
    # greedy everywhere: every configuration, ours and transformers', produces our AR tokens
    assert all(r["matches_ar"] == 1.0 for r in res["rows"]), [(r["method"], r["matches_ar"]) for r in res["rows"]]
    assert all(r["new_tokens"] == 18 and r["tokens_per_s"] > 0 for r in res["rows"])
    ours = [r for r in res["rows"] if r["engine"] == "nemo_spec"]
    assert all(r["verify_ms_per_step"] > 0 and r["draft_ms_per_step"] >= 0 for r in ours)  # per decode step, split
    assert all(r.get("draft_ms_per_step") is None for r in res["rows"] if r["engine"] == "transformers")
    assert "ar_vs_transformers_b1" in res["summary"] and "best_speculative_b1" in res["summary"]
    t, tb = [t for t in res["targets"] if not t["name"].startswith("suffix")]  # no EAGLE model: AR's, best method's
    assert t["value"] == res["summary"]["ar_vs_transformers_b1"] and t["met"] == (t["value"] >= 1.0)
    # the best of all our methods (plain decoding included) against transformers' best, at the same batch size
    b1 = [r for r in res["rows"] if r["batch_size"] == 1]
    ours = max((r for r in b1 if r["engine"] == "nemo_spec"), key=lambda r: r["tokens_per_s"])
    theirs = max((r for r in b1 if r["engine"] == "transformers"), key=lambda r: r["tokens_per_s"])
    best = res["summary"]["best_method_vs_transformers_best_b1"]
    assert best == {"ours": ours["method"], "theirs": theirs["method"],
                    "ratio": ours["tokens_per_s"] / theirs["tokens_per_s"]}
    assert tb["name"] == f"our best method ({ours['method']}) tokens/s vs transformers' best ({theirs['method']})"
    assert tb["value"] == best["ratio"] and tb["met"] == (best["ratio"] >= 1.5)
    paths = bench.write_outputs(res, tmp_path / "out")
    md = paths["benchmark.md"].read_text()
    assert "- target at batch 1: our AR tokens/s vs transformers generate >= 1: " in md
    assert (f"- best_method_vs_transformers_best_b1: our {best['ours']} at {best['ratio']:.2f}x transformers' "
            f"{best['theirs']}") in md
    assert json.loads(paths["benchmark.json"].read_text())["config"]["max_new_tokens"] == 6
    assert "| transformers | assistant_model | 1 |" in paths["benchmark.md"].read_text()
    assert paths["benchmark.png"].read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(SamplingError, match="not available"):
        bench.benchmark(model, prompts, None, methods=["eagle"], hf=False)


def test_the_transformers_baseline_is_plain_transformers(ckpt):
    # transformers 5.25 loads models with Hub kernels on by default (modeling_utils.py from_pretrained, use_kernels
    # None -> True): the baseline would fetch kernels at run time on GPU; it is loaded with them off
    path, _, _ = ckpt
    m = bench._load_hf(path, torch.device("cpu"), torch.float32)
    assert getattr(m, "use_kernels", False) is False


def test_benchmark_continuous_schedule(ckpt, tmp_path, monkeypatch):
    """--schedule continuous: our rows run all prompts through one session of <batch> slots (one generate call with
    max_batch), not consecutive fixed batches; same greedy tokens; transformers' rows stay fixed batches; the
    schedule is recorded in the rows, the config and the markdown; an unknown schedule is an error."""
    from nemo_spec.checkpoint import load_model

    path, draft, tok = ckpt
    model, dmodel = load_model(path), load_model(draft)
    prompts = [tok.encode(t, add_special_tokens=False) for t in ["the cat sat on", "the dog", "in the tree the bird"]]
    calls = []
    real = bench.generate

    def spy(model, prompts, params, **kw):
        calls.append((len(prompts), params.max_new_tokens, (kw.get("options") or {}).get("max_batch")))
        return real(model, prompts, params, **kw)

    monkeypatch.setattr(bench, "generate", spy)
    kw = dict(methods=["ar", "draft_model"], batch_sizes=(2,), max_new_tokens=6, hf=False, repeats=1,
              options={"num_draft_tokens": 3})
    fixed = bench.benchmark(model, prompts, dmodel, **kw)
    # per method (ar, draft_model): a warm-up on the first batch, then two batches
    assert calls == [(2, 6, None), (2, 6, None), (1, 6, None)] * 2
    calls.clear()
    cont = bench.benchmark(model, prompts, dmodel, schedule="continuous", **kw)
    assert calls == [(2, 6, 2), (3, 6, 2)] * 2  # per method: the warm-up, then one session of 2 slots
    assert all(r["schedule"] == "continuous" for r in cont["rows"]) and cont["config"]["schedule"] == "continuous"
    by = {r["method"]: r["tokens"] for r in fixed["rows"]}
    assert all(r["tokens"] == by[r["method"]] == by["ar"] for r in cont["rows"])  # greedy: the same tokens
    assert "continuous batching over <batch> slots" in bench.to_markdown(cont)
    assert "continuous" not in bench.to_markdown(fixed)
    with pytest.raises(SamplingError, match="unknown schedule"):
        bench.benchmark(model, prompts, None, methods=["ar"], hf=False, schedule="greedy")
    with pytest.raises(SystemExit):
        bench.build_parser().parse_args(["--model", "x", "--schedule", "rolling"])
    assert bench.build_parser().parse_args(["--model", "x", "--schedule", "continuous"]).schedule == "continuous"


def test_benchmark_times_the_few_row_kernels_before_its_first_round(ckpt, monkeypatch):
    """Under the timed kernel rule the benchmark times every row count 1..MAX_TUNED_ROWS of every model before the
    first generation (warm-up included), as the server does at load, so no timed round pauses to tune a new row
    count; under a fixed rule nothing is timed. The seconds spent are in the config."""
    from nemo_spec.checkpoint import load_model
    from nemo_spec.models import fastpath

    path, draft, tok = ckpt
    model, dmodel = load_model(path), load_model(draft)
    prompts = [tok.encode(t, add_special_tokens=False) for t in ["the cat sat on", "in the tree the bird"]]
    seen = []
    real = bench.generate

    def spy(m, p, params, **kw):  # what had been timed when each generation started
        seen.append((timed_rows(model), timed_rows(dmodel)))
        return real(m, p, params, **kw)

    monkeypatch.setattr(bench, "generate", spy)
    kw = dict(methods=["ar", "draft_model"], batch_sizes=(1,), max_new_tokens=4, hf=False, repeats=1,
              options={"num_draft_tokens": 2})
    res = bench.benchmark(model, prompts, dmodel, **kw)  # the suite's fixed rule: nothing to time
    assert seen and all(s == (set(), set()) for s in seen) and res["config"]["pretune_s"] >= 0
    seen.clear()
    monkeypatch.setattr(fastpath, "SMALL_GEMM", "auto")
    res = bench.benchmark(model, prompts, dmodel, **kw)
    every = set(range(1, fastpath.MAX_TUNED_ROWS + 1))
    assert seen and all(s == (every, every) for s in seen)
    assert res["config"]["pretune_s"] > 0 and res["config"]["small_gemm"] == "auto"


def test_benchmark_small_gemm_rules_side_by_side(ckpt, tmp_path):
    """--gemm: every method once more under another small-row CPU kernel rule in the same round robin, the rule
    restored after each row; the summary says how the rule in force compares; an unknown rule is an error.
    --forward-rows: single target forwards timed per row count and rule."""
    from nemo_spec.checkpoint import load_model
    from nemo_spec.models import fastpath

    path, _, tok = ckpt
    model = load_model(path)
    prompts = [tok.encode(t, add_special_tokens=False) for t in ["the cat sat on", "in the tree the bird"]]
    before = fastpath.SMALL_GEMM
    res = bench.benchmark(model, prompts, None, methods=["ar", "prompt_lookup"], batch_sizes=(1,), max_new_tokens=6,
                          hf=False, repeats=1, gemm_modes=["linear", "auto"])
    assert fastpath.SMALL_GEMM == before
    rows = {r["method"]: r for r in res["rows"]}
    assert set(rows) == {"ar", "prompt_lookup", "ar+gemm=linear", "ar+gemm=auto", "prompt_lookup+gemm=linear",
                         "prompt_lookup+gemm=auto"}
    assert rows["ar+gemm=linear"]["tokens"] == rows["ar"]["tokens"]  # the tests' rule in force is linear too
    assert all(len(t) == 6 for r in rows.values() for t in r["tokens"])
    s = res["summary"]
    assert s["ar_vs_gemm=auto_b1"] == rows["ar"]["tokens_per_s"] / rows["ar+gemm=auto"]["tokens_per_s"]
    assert s["best_speculative_b1"]["method"] == "prompt_lookup"  # comparison rows are not candidates
    pl = rows["prompt_lookup+gemm=linear"]  # its speed-up is taken against AR under the same rule
    assert pl["speedup_vs_ar"] == pl["tokens_per_s"] / rows["ar+gemm=linear"]["tokens_per_s"]
    assert res["config"]["gemm_modes"] == ["linear", "auto"]
    with pytest.raises(SamplingError, match="small-row kernel modes"):
        bench.benchmark(model, prompts, None, methods=["ar"], hf=False, gemm_modes=["fastest"])
    # --forward-rows: cached target forwards of n new tokens under each rule, side by side
    fw = bench.time_forwards(model, [1, 3], context=8, calls=1, rounds=2)
    assert [(r["rows"], r["mode"]) for r in fw] == [(1, "linear"), (1, "auto"), (3, "linear"), (3, "auto")]
    assert all(r["ms"] > 0 for r in fw) and fastpath.SMALL_GEMM == before
    table = bench.forwards_markdown(fw)
    assert table.splitlines()[0] == "| rows | linear ms | auto ms | auto vs linear |" and len(table.splitlines()) == 4
    for t in (table, bench.forwards_markdown([r for r in fw if r["mode"] == "auto"])):  # one rule: no ratio column
        head, sep = t.splitlines()[:2]
        assert head.count("|") == sep.count("|") == t.splitlines()[2].count("|")
    with pytest.raises(SamplingError, match="exceeds the model context"):
        bench.time_forwards(model, [4], context=10 ** 6)
    with pytest.raises(SamplingError, match="small-row kernel modes"):
        bench.time_forwards(model, [1], modes=["fast"])


def test_benchmark_targets_pick_the_batch1_eagle_rows():
    row = lambda m, b, sp, tau=1.0: {"engine": "nemo_spec", "method": m, "batch_size": b, "speedup_vs_ar": sp,  # noqa: E731
                                     "tau": tau}
    rows = [row("ar", 1, 1.0), row("eagle", 1, 1.8, 3.4), row("eagle_tree", 1, 1.5, 3.6), row("eagle", 8, 2.5, 3.4)]
    got = {t["name"]: (t["value"], t["target"], t["met"]) for t in bench.check_targets(rows, {"ar_vs_transformers_b1": 0.9})}
    assert got == {"EAGLE tree tau": (3.6, 3.5, True), "EAGLE (eagle) tokens/s vs our AR": (1.8, 2.0, False),
                   "our AR tokens/s vs transformers generate": (0.9, 1.0, False)}


def test_benchmark_outputs_are_written_through_a_temporary_name(tmp_path):
    """Benchmark result files (benchmark.py, --forward-rows, benchmark_serve.py --json) are replaced whole: a write
    that fails leaves the previous file as it was and no temporary file behind."""
    from nemo_spec.fsutil import write_text_atomic

    out = tmp_path / "forwards.json"
    assert write_text_atomic(out, '{"a": 1}') == out and out.read_text() == '{"a": 1}'
    with pytest.raises(UnicodeEncodeError):
        write_text_atomic(out, "x" * 100 + "\ud800")  # a lone surrogate: fails after the file was opened
    assert out.read_text() == '{"a": 1}' and [p.name for p in tmp_path.iterdir()] == ["forwards.json"]
    write_text_atomic(out, "new")
    assert out.read_text() == "new" and len(list(tmp_path.iterdir())) == 1
