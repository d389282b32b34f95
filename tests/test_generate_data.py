"""generate_data end to end: regenerate a chat dataset through a live server with the openai client, resume."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import jinja2
import pytest

from nemo_spec.data import read_conversations
from nemo_spec.datagen import DatagenConfig, DatagenError, finished_ids, generate_data
from nemo_spec.inference import SamplingParams, generate
from tests.helpers import ROOT
from tests.serve_utils import CHAT_TEMPLATE, clone_model, live_server, served_text, tiny_model, train_tokenizer

SYSTEM = "we read code"


def _dataset(d: Path) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    da = [{"id": f"da{i}", "system": "the cat" if i == 0 else "", "mask": "User",
           "conversations": [{"from": "User", "value": f"hello world {i}"},
                             {"from": "Assistant", "value": "old answer"},
                             {"from": "User", "value": "fix bugs"},
                             {"from": "Assistant", "value": "old answer two"}][: 2 if i % 2 else 4]}
          for i in range(4)]
    (d / "da.jsonl").write_text("".join(json.dumps(r) + "\n" for r in da))
    sg = [{"id": f"sg{i}", "conversations": [{"from": "human", "value": f"the dog ran to {i}"},
                                             {"from": "gpt", "value": "stale"}]} for i in range(2)]
    (d / "sharegpt.jsonl").write_text("".join(json.dumps(r) + "\n" for r in sg))
    return d


def _expected(ref, tok, record, max_tokens):
    """Replay a regenerated record with plain generate(): every assistant turn must be the greedy reply."""
    system = record["system"] or SYSTEM
    msgs = [{"role": "system", "content": system}]
    out = []
    for t in record["conversations"]:
        if t["from"] == "User":
            msgs.append({"role": "user", "content": t["value"]})
            continue
        text = jinja2.Template(CHAT_TEMPLATE).render(messages=msgs, add_generation_prompt=True,
                                                     eos_token=tok.eos_token)
        ids = tok(text, add_special_tokens=False).input_ids
        res = generate(ref, [ids], SamplingParams(temperature=0.0, max_new_tokens=max_tokens,
                                                  stop_token_ids=(tok.eos_token_id,)))[0]
        reply = served_text(tok, ids, res.tokens)  # the server's text continues the prompt
        out.append(reply)
        msgs.append({"role": "assistant", "content": reply})
    return out


def _load_script():
    spec = importlib.util.spec_from_file_location("generate_data_script", ROOT / "scripts" / "generate_data.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_generate_data_end_to_end_and_resume(tmp_path):
    tok = train_tokenizer(tmp_path / "tok")
    model = tiny_model(tok)
    ref = clone_model(model)
    data = _dataset(tmp_path / "data")
    out = tmp_path / "out" / "regen.jsonl"
    with live_server(model, tok, name="tiny", max_batch=8) as srv:
        base = f"{srv.url}/v1"
        cfg = DatagenConfig(input=str(data), output=str(out), model="tiny", base_url=base, system_prompt=SYSTEM,
                            concurrency=4, max_tokens=10, limit=3)
        s1 = generate_data(cfg)
        assert (s1.total, s1.written, s1.skipped_existing, s1.failed) == (3, 3, 0, 0)
        assert len(out.read_text().splitlines()) == 3
        # an interrupted run leaves a partial line: it is dropped and that record is redone
        with open(out, "a") as f:
            f.write('{"id": "da3", "system": "')
        rc = _load_script().main(["--input", str(data), "--output", str(out), "--model", "tiny", "--base-url", base,
                                  "--system-prompt", SYSTEM, "--concurrency", "4", "--max-tokens", "10"])
        assert rc == 0
        lines = out.read_text().splitlines()
        assert len(lines) == 6
        assert finished_ids(out) == {"da0", "da1", "da2", "da3", "sg0", "sg1"}
        # a third run has nothing left to do
        s3 = generate_data(DatagenConfig(input=str(data), output=str(out), model="tiny", base_url=base,
                                         system_prompt=SYSTEM, max_tokens=10))
        assert (s3.written, s3.skipped_existing) == (0, 6)
        assert json.loads((tmp_path / "out" / "regen.jsonl.config.json").read_text())["model"] == "tiny"

    recs = {json.loads(l)["id"]: json.loads(l) for l in lines}
    assert recs["da0"]["system"] == "the cat" and recs["da1"]["system"] == SYSTEM
    for rid, rec in recs.items():
        roles = [t["from"] for t in rec["conversations"]]
        assert roles == ["User", "Assistant"] * (len(roles) // 2)
        replies = [t["value"] for t in rec["conversations"] if t["from"] == "Assistant"]
        assert "old answer" not in replies and "stale" not in replies
        assert replies == _expected(ref, tok, rec, 10), rid
    # the output is training-ready Daring-Anteater JSONL
    back = read_conversations(str(out), fmt="daring_anteater", strict=True)
    assert len(back) == 6 and all(r["turns"][-1]["role"] == "assistant" for r in back)


def test_generate_data_config_errors(tmp_path):
    with pytest.raises(DatagenError, match="does not exist"):
        DatagenConfig(input=str(tmp_path / "nope.jsonl"), output=str(tmp_path / "o.jsonl"), model="m").validate()
    src = _dataset(tmp_path / "d") / "da.jsonl"
    with pytest.raises(DatagenError, match="concurrency"):
        DatagenConfig(input=str(src), output=str(tmp_path / "o.jsonl"), model="m", concurrency=0).validate()
    with pytest.raises(DatagenError, match="must differ"):
        DatagenConfig(input=str(src), output=str(src), model="m").validate()
    bad = tmp_path / "bad.jsonl"
    bad.write_text("not json\n")
    with pytest.raises(DatagenError, match="bad.jsonl:1"):
        finished_ids(bad)
    with pytest.raises(DatagenError, match="inside the input directory"):  # a rerun would read its own output
        DatagenConfig(input=str(src.parent), output=str(src.parent / "sub" / "o.jsonl"), model="m").validate()


class _Client:
    """An OpenAI-client stand-in answering every chat request with "ok" (records the calls)."""

    def __init__(self, interrupt_after=None):
        self.calls, self.closed, self.interrupt_after = 0, False, interrupt_after
        self.chat = self
        self.completions = self

    def create(self, **kw):
        import types

        self.calls += 1
        if self.interrupt_after is not None and self.calls > self.interrupt_after:
            raise KeyboardInterrupt
        msg = types.SimpleNamespace(content="ok")
        return types.SimpleNamespace(choices=[types.SimpleNamespace(message=msg, finish_reason="stop")],
                                     usage=types.SimpleNamespace(completion_tokens=1))

    def close(self):
        self.closed = True


def test_generate_data_resume_ids_do_not_depend_on_how_the_input_was_named(tmp_path, monkeypatch):
    """From a review: records without ids were named '<path as typed>:<line>', so the same job rerun with an
    absolute path (or from another directory) skipped nothing and wrote every conversation twice; a UTF-8 BOM
    lost the first record; many ids were checked for duplicates in quadratic time."""
    rows = [{"conversations": [{"from": "User", "value": f"q{i}"}, {"from": "Assistant", "value": "a"}]}
            for i in range(5)]
    (tmp_path / "chats.jsonl").write_bytes(b"\xef\xbb\xbf" + "".join(json.dumps(r) + "\n" for r in rows).encode())
    monkeypatch.chdir(tmp_path)
    first = generate_data(DatagenConfig(input="chats.jsonl", output=str(tmp_path / "o.jsonl"), model="m"), _Client())
    assert (first.total, first.written) == (5, 5)
    again = generate_data(DatagenConfig(input=str(tmp_path / "chats.jsonl"), output=str(tmp_path / "o.jsonl"),
                                        model="m"), _Client())
    assert (again.skipped_existing, again.written) == (5, 0)
    out = [json.loads(line) for line in (tmp_path / "o.jsonl").read_text().splitlines()]
    out.sort(key=lambda r: r["id"])
    assert [r["id"] for r in out] == [f"chats.jsonl:{i}" for i in range(1, 6)]  # no directory in the ids
    # an output an earlier version wrote with ids spelt as its input path was typed still resumes
    old = tmp_path / "old.jsonl"
    old.write_text("".join(json.dumps({**r, "id": f"{tmp_path}/./chats.jsonl:{i + 1}"}) + "\n"
                           for i, r in enumerate(out[:3])))
    resumed = generate_data(DatagenConfig(input="chats.jsonl", output=str(old), model="m"), _Client())
    assert (resumed.skipped_existing, resumed.written) == (3, 2)


def test_an_interrupted_generate_data_starts_nothing_more_and_resumes(tmp_path):
    """Ctrl-C used to wait for every queued conversation, sending their requests and dropping the replies."""
    rows = [{"id": f"r{i}", "conversations": [{"from": "User", "value": f"q{i}"},
                                              {"from": "Assistant", "value": "a"}]} for i in range(40)]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = lambda: DatagenConfig(input=str(tmp_path / "in.jsonl"), output=str(tmp_path / "o.jsonl"), model="m",  # noqa: E731
                                concurrency=1)
    client = _Client(interrupt_after=3)
    with pytest.raises(KeyboardInterrupt):
        generate_data(cfg(), client)
    assert client.calls in (4, 5) and client.closed  # at most the one queued beside it started, not the 36 others
    written = len((tmp_path / "o.jsonl").read_text().splitlines())
    assert written == 3
    rest = generate_data(cfg(), _Client())
    assert (rest.skipped_existing, rest.written) == (3, 37)


def test_generate_data_counts_failures_and_retries_them_on_resume(tmp_path):
    """A server error on one record is counted, the record is not written, and a rerun fills it in."""
    tok = train_tokenizer(tmp_path / "tok")
    data = _dataset(tmp_path / "data")
    out = tmp_path / "regen.jsonl"
    with live_server(tiny_model(tok), tok, name="tiny") as srv:
        base = f"{srv.url}/v1"
        # max_tokens beyond the context: every request gets a 400 from the server -> all records fail
        bad = generate_data(DatagenConfig(input=str(data), output=str(out), model="tiny", base_url=base,
                                          max_tokens=10_000, max_retries=0))
        assert (bad.written, bad.failed) == (0, 6) and "context" in bad.failures[0]
        good = generate_data(DatagenConfig(input=str(data), output=str(out), model="tiny", base_url=base,
                                           max_tokens=4))
        assert (good.written, good.failed, good.skipped_existing) == (6, 0, 0)
