"""The serving benchmark's late-request measurement (scripts/benchmark_serve.py --late) on a real server."""
from nemo_spec.checkpoint import save_checkpoint
from nemo_spec.serve.benchmark import format_late, late_request
from tests.serve_utils import tiny_model, tok, tok_dir  # noqa: F401  (fixtures)


def test_late_short_request_joins_the_running_batch_only_with_the_continuous_scheduler(tok, tok_dir, tmp_path):
    """A 3-token request sent while a 240-token one streams (after its 8th token: a fixed delay would depend on the
    machine's speed): the session admits it at the next step and it finishes long before the long one; the old
    batcher starts it only after the long request's batch has finished."""
    ckpt = save_checkpoint(tiny_model(tok, num_layers=4), tmp_path / "ckpt", tokenizer_dir=tok_dir)
    res = {r.scheduler: r for r in late_request(str(ckpt), long_tokens=240, short_tokens=3, delay_s=0.0,
                                                max_batch=4, prompt="hello world", after_tokens=8)}
    cont, old = res["continuous"], res["batch"]
    assert cont.short_done_before_long_s > 0 > old.short_done_before_long_s
    assert cont.late_ttft_s < old.late_ttft_s
    assert cont.step_s > 0 and old.step_s > 0
    table = format_late(list(res.values()))
    assert "continuous" in table and "batch" in table
