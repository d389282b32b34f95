"""Quickstart pipeline: stage availability, clear errors for missing stages, config validation, and the README's
smoke run end to end with its stage cache."""
import dataclasses
import shlex

import pytest

from nemo_spec.base import quickstart as Q
from nemo_spec.config import ConfigError
from tests.helpers import readme_smoke_commands, run_readme_command


def test_all_stages_available_in_this_checkout():
    for stage in Q.STAGES:
        assert Q.stage_available(stage) is None, stage
    with pytest.raises(ConfigError, match="unknown quickstart stage 'deploy'"):
        Q.stage_available("deploy")


def test_missing_stage_named_before_any_work(monkeypatch, tmp_path):
    monkeypatch.setitem(Q.STAGE_REQUIREMENTS, "speculate", ("nemo_spec.no_such_module", None))
    assert "nemo_spec.no_such_module" in Q.stage_available("speculate")
    cfg = Q.QuickstartConfig(preset="tiny", cache_dir=str(tmp_path), stages=["speculate", "train"])
    with pytest.raises(Q.QuickstartError, match="stopped before stage 'speculate'.*nemo_spec.no_such_module"):
        Q.run_quickstart(cfg)
    assert not (tmp_path / "base").exists()  # nothing was built
    monkeypatch.setitem(Q.STAGE_REQUIREMENTS, "export", ("nemo_spec.export.cli", "scripts/no_such_script.py"))
    assert "scripts/no_such_script.py" in Q.stage_available("export")


def test_stage_needs_base_and_config_validation(tmp_path):
    with pytest.raises(Q.QuickstartError, match="needs the 'base' stage"):
        Q.run_quickstart(Q.QuickstartConfig(preset="tiny", cache_dir=str(tmp_path), stages=["data"]))
    with pytest.raises(ConfigError, match=r"stages \['deploy'\] unknown"):
        Q.QuickstartConfig(stages=["base", "deploy"]).validate()
    with pytest.raises(ConfigError, match="train_steps must be a positive int"):
        Q.QuickstartConfig(train_steps=0).validate()
    with pytest.raises(ConfigError, match="extra has unknown stage"):
        Q.QuickstartConfig(extra={"nope": ["x"]}).validate()
    with pytest.raises(ConfigError, match="train_precision must be one of"):
        Q.QuickstartConfig(train_precision="bf16").validate()


def test_train_precision_auto_follows_the_cpu(monkeypatch):
    """auto trains in bf16 autocast only where the CPU multiplies bf16 natively; an explicit choice wins."""
    import nemo_spec._cpu as cpu

    for native, want in ((True, "bf16-mixed"), (False, "32-true")):
        monkeypatch.setattr(cpu, "native_bf16", lambda native=native: native)
        assert Q.train_precision(Q.QuickstartConfig()) == want
        assert Q.train_precision(Q.QuickstartConfig(train_precision="32-true")) == "32-true"
    args = Q.build_parser().parse_args(["--train_precision", "bf16-mixed"])
    assert Q.config_from_args(args).train_precision == "bf16-mixed"


def test_train_stage_gets_the_precision(monkeypatch, tmp_path):
    """The resolved precision is the train stage's trainer.precision (and in its cache key); fp32 adds nothing, so
    an fp32 run keeps the key it had before the option existed."""
    import json

    import nemo_spec._cpu as cpu

    spec = tmp_path / "speculate"
    spec.mkdir()
    (spec / "nemo_spec_config.json").write_text(json.dumps({"speculative": {"algorithm": "eagle3"}}))
    commands = []

    class Ran(Exception):
        pass

    def fake_run(stage, argv, log):
        commands.append(argv)
        raise Ran

    monkeypatch.setattr(Q, "_run", fake_run)
    for native in (True, False):
        monkeypatch.setattr(cpu, "native_bf16", lambda native=native: native)
        res = Q.QuickstartResult(work_dir=tmp_path / f"w{native}")
        res.outputs.update(speculate=spec, data=tmp_path / "data")
        with pytest.raises(Ran):
            Q._stage_train(Q.QuickstartConfig(preset="tiny"), None, res)
    bf16, fp32 = commands
    assert "trainer.precision=bf16-mixed" in bf16
    assert not any(a.startswith("trainer.precision=") for a in fp32)

    def rest(argv):
        return [a for a in argv if not a.startswith(("trainer.precision=", "run_dir="))]

    assert rest(bf16) == rest(fp32)


def test_cli_reports_missing_stage(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(Q.STAGE_REQUIREMENTS, "speculate", ("nemo_spec.no_such_module", None))
    rc = Q.main(["--preset", "tiny", "--cache_dir", str(tmp_path), "--stages", "speculate"])
    assert rc == 2
    assert "stopped before stage 'speculate'" in capsys.readouterr().err


def test_stage_cache_is_keyed_by_settings_chained_through_the_stages(tmp_path):
    """distill reads data: its key chains data's (stages by the names run_quickstart gives them)."""
    res = Q.QuickstartResult(work_dir=tmp_path)
    out_a, out_b = tmp_path / "a", tmp_path / "b"

    def run(settings_a, settings_b):
        res.fingerprints.clear()
        done = []
        for stage, settings, out in (("data", settings_a, out_a), ("distill", settings_b, out_b)):
            if not Q._reuse_or_reset(res, stage, settings, [out], (out / "done").is_file):
                out.mkdir(exist_ok=True)
                (out / "partial").write_text("x")
                (out / "done").write_text(str(settings))
                done.append(stage)
        return done

    assert run(1, 1) == ["data", "distill"]
    assert run(1, 1) == []                    # same settings: both reused
    assert run(1, 2) == ["distill"]           # only distill changed
    assert run(2, 2) == ["data", "distill"]   # data changed: distill reads it
    assert (out_b / "done").read_text() == "2"
    (out_b / "done").unlink()                 # distill interrupted after a partial write, same settings:
    assert not Q._reuse_or_reset(res, "distill", 2, [out_b], (out_b / "done").is_file)
    assert (out_b / "partial").is_file()      # ... its partial output is kept (resume)
    assert not Q._reuse_or_reset(res, "distill", 3, [out_b], (out_b / "done").is_file)
    assert not out_b.exists()                 # other settings: the stale output is removed first


def test_stage_cache_follows_what_each_stage_reads(tmp_path):
    """A changed transform (e.g. the draft vocabulary) redoes the transform, training, export and benchmark but
    keeps the data and the self-distilled chats, which do not read it; changed data redoes everything after it."""
    res = Q.QuickstartResult(work_dir=tmp_path)

    def run(**changed):
        res.fingerprints.clear()
        redone = []
        for stage in Q.STAGES:
            out = tmp_path / stage
            settings = changed.get(stage, 0)
            if not Q._reuse_or_reset(res, stage, settings, [out], (out / "done").is_file):
                out.mkdir()
                (out / "done").write_text(str(settings))
                redone.append(stage)
        return redone

    assert run() == list(Q.STAGES)
    assert run() == []
    assert run(speculate=1) == ["speculate", "train", "export", "benchmark"]
    assert run(speculate=1, distill=1) == ["distill", "train", "export", "benchmark"]
    assert run(speculate=1, distill=1, data=1) == ["data", "distill", "train", "export", "benchmark"]
    assert run(speculate=1, distill=1, data=1, base=1) == list(Q.STAGES)


def test_readme_smoke_run_as_written_then_cached_then_partly_redone():
    """The README's quickstart smoke command, run literally from nothing (tests.helpers.run_readme_command), prints
    its table; the same settings in-process reuse every stage with the same table; one benchmark setting changed
    redoes only the benchmark (the stamps chain the settings through the stages)."""
    cmds = [c for c in readme_smoke_commands() if c.startswith("python scripts/quickstart.py")]
    assert cmds, "the README has no quickstart smoke command"
    for cmd in cmds:
        proc = run_readme_command(cmd)
        for row in ("| nemo_spec | ar | 1 |", "| nemo_spec | eagle | 1 |", "| nemo_spec | eagle_tree | 1 |",
                    "| transformers | plain | 1 |", "- target at batch 1: EAGLE tree tau >= 3.5: "):
            assert row in proc.stdout, proc.stdout[-3000:]
        cfg = Q.config_from_args(Q.build_parser().parse_args(shlex.split(cmd)[2:]))
        again = Q.run_quickstart(cfg)
        assert again.cached == list(Q.BUILTIN_STAGES)
        assert again.table and again.table in proc.stdout
        assert (again.outputs["export"] / "README.md").is_file()
        changed = Q.run_quickstart(dataclasses.replace(cfg, max_new_tokens=4))
        assert changed.cached == ["base", "speculate", "data", "train", "export"]
        assert f"{cfg.num_prompts} prompts, 4 new tokens each" in changed.table
