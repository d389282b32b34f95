"""What a user sees from the command line: no expected-fallback warnings, one-line user errors (exit 2),
undecodable data lines treated as malformed records, and the README's smoke commands running as written."""
from __future__ import annotations

import re
import subprocess
import sys

import pytest

from nemo_spec.data.formats import DataFormatError, ReadStats, read_conversations
from tests.helpers import ROOT, readme_smoke_commands, run_readme_command, script_env

SCRIPTS = sorted(p.name for p in (ROOT / "scripts").glob("*.py"))


_env = script_env


def _run(args, timeout=300, cwd=ROOT):
    return subprocess.run([sys.executable, *map(str, args)], cwd=cwd, env=_env(), capture_output=True, text=True,
                          timeout=timeout)


def test_every_script_help_is_free_of_fallback_warnings():
    procs = {s: subprocess.Popen([sys.executable, str(ROOT / "scripts" / s), "--help"], cwd=ROOT, env=_env(),
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for s in SCRIPTS}
    for s, p in procs.items():
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, (s, err[-2000:])
        assert "usage" in (out + err).lower() or "powered by hydra" in out.lower(), s
        for pattern in ("Transformer Engine", "Apex", "Warning"):
            assert pattern not in err, (s, err[-2000:])


def test_expected_fallbacks_are_quiet_but_other_warnings_show():
    code = ("import warnings\nfrom nemo_spec import entry\nentry.setup()\n"
            "warnings.warn('Transformer Engine and Apex are not installed. Falling back to Torch optimizers.')\n"
            "warnings.warn('something real went wrong')\n")
    proc = _run(["-c", code])
    assert proc.returncode == 0, proc.stderr
    assert "Transformer Engine" not in proc.stderr and "something real went wrong" in proc.stderr


@pytest.fixture(scope="module")
def hf_ckpt(tmp_path_factory):
    from nemo_spec.checkpoint.hf import export_hf
    from tests.serve_utils import tiny_model, train_tokenizer

    d = tmp_path_factory.mktemp("cli")
    tok = train_tokenizer(d / "tok")
    return export_hf(tiny_model(tok), d / "hf", tokenizer_dir=d / "tok")


def _one_line_error(proc, *needles):
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, proc.stderr[-3000:]
    for n in needles:
        assert n in errors[0], errors[0]


def test_training_on_an_empty_or_undecodable_file_is_a_one_line_error(hf_ckpt, tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b'{"conversations": [{"from": "User", "value": "hi \xff\xfe"}]}\n')
    common = ["scripts/train_speculative.py", f"model_path={hf_ckpt}", "spec=eagle3", "trainer.max_steps=1",
              f"hydra.run.dir={tmp_path / 'h'}"]
    _one_line_error(_run([*common, f"data.path={empty}", f"run_dir={tmp_path / 'r1'}"]), str(empty))
    _one_line_error(_run([*common, f"data.path={bad}", f"run_dir={tmp_path / 'r2'}", "data.strict=true"]),
                    f"{bad}:1", "UTF-8")
    # --debug shows the whole trace
    dbg = _run([*common, f"data.path={empty}", f"run_dir={tmp_path / 'r3'}", "--debug"])
    assert dbg.returncode != 0 and "Traceback" in dbg.stderr


@pytest.mark.parametrize("args,needle", [
    (["scripts/gpt_speculate.py", "--model_path", "/no/such/ckpt", "--export_dir", "/tmp/x", "--algorithm", "eagle3",
      "--num_eagle_layers", "1"], "/no/such/ckpt"),
    (["scripts/generate.py", "--model", "/no/such/ckpt", "hi"], "/no/such/ckpt"),
    (["scripts/export.py", "--checkpoint", "/no/such/ckpt", "--export_dir", "/tmp/x"], "/no/such/ckpt"),
    (["scripts/serve.py", "model.path=/no/such/ckpt"], "/no/such/ckpt"),
    (["scripts/convert_hf.py", "import", "/no/such/ckpt", "/tmp/x"], "/no/such/ckpt"),
    (["scripts/generate_data.py", "--input", "/no/such/ckpt", "--output", "/tmp/x.jsonl", "--model", "m"],
     "/no/such/ckpt"),
])
def test_missing_checkpoint_is_a_one_line_error(args, needle, tmp_path):
    if args[0] == "scripts/serve.py":
        args = [*args, f"hydra.run.dir={tmp_path}"]
    proc = _run(args)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and needle in proc.stderr, proc.stderr[-3000:]
    assert "(run with --debug for the full traceback)" in proc.stderr, proc.stderr[-3000:]
    if args[0] in ("scripts/gpt_speculate.py", "scripts/export.py", "scripts/convert_hf.py",
                   "scripts/generate_data.py"):  # they return 2 themselves: --debug too
        dbg = _run([*args, "--debug"])
        assert dbg.returncode != 0 and "Traceback" in dbg.stderr and needle in dbg.stderr, dbg.stderr[-3000:]


def test_undecodable_lines_are_malformed_records(tmp_path):
    f = tmp_path / "d.jsonl"
    good = b'{"conversations": [{"from": "User", "value": "hi"}, {"from": "Assistant", "value": "yo"}]}\n'
    f.write_bytes(good + b'{"conversations": [{"from": "User", "value": "\xc3\x28"}]}\n' + good)
    stats = ReadStats()
    recs = read_conversations(f, stats=stats)
    assert len(recs) == 2 and stats.kept == 2 and stats.skipped == 1
    with pytest.raises(DataFormatError, match=rf"{re.escape(str(f))}:2: invalid UTF-8"):
        read_conversations(f, strict=True)
    lst = tmp_path / "l.json"
    lst.write_bytes(b'[\n{"conversations": []},\n"\xff"\n]')
    with pytest.raises(DataFormatError, match=rf"{re.escape(str(lst))}:3: invalid UTF-8"):
        read_conversations(lst, strict=True)


# ------------------------------------------------------------------------------------ README commands

def test_readme_has_smoke_commands():
    cmds = readme_smoke_commands()
    assert cmds and all(c.startswith("python scripts/") for c in cmds), cmds


# quickstart smoke commands are run as written by tests/test_base_quickstart.py, which then checks their cache
_OTHER_SMOKE = [c for c in readme_smoke_commands() if not c.startswith("python scripts/quickstart.py")]
if _OTHER_SMOKE:
    @pytest.mark.parametrize("cmd", _OTHER_SMOKE)
    def test_readme_smoke_command_runs_as_written(cmd):
        run_readme_command(cmd)


def test_generate_compile_flag_before_a_prompt_takes_the_default_mode():
    """`generate.py --model M --compile "def f():"`: argparse took the prompt as the compile mode and refused it
    (found by review); a bare --compile before a prompt is the default mode, a named mode still works."""
    from nemo_spec.inference.cli import _bare_compile, build_parser

    a = build_parser().parse_args(_bare_compile(["--model", "m", "--compile", "def f():"]))
    assert a.compile == "default" and "def f():" in a.prompts
    b = build_parser().parse_args(_bare_compile(["--model", "m", "--compile", "max-autotune", "hi"]))
    assert b.compile == "max-autotune" and "hi" in b.prompts
    c = build_parser().parse_args(_bare_compile(["--model", "m", "hi", "--compile"]))
    assert c.compile == "default"
