"""`hybridlm bench`'s rates table and per-layer timing (`--per-layer`)."""

import json

from click.testing import CliRunner

from hybridlm.cli import cli


def test_bench_reports_the_rates_and_each_layers_time(tmp_path, toy_hub, toy_model):
    out = tmp_path / "bench.json"
    r = CliRunner().invoke(cli, ["bench", "--model", str(toy_hub[0]), "--quick", "--no-references", "--threads", "1",
                                 "--precisions", "", "--sections", "rates", "--per-layer", "--out", str(out)])
    assert r.exit_code == 0, r.output
    report = json.loads(out.read_text())
    L = toy_model.config.n_layer
    rates = report["rates"]
    assert rates["token_steps"] == 16 and rates["layers"] == L and rates["jumps"] == 0
    assert abs(rates["layer_steps_per_s"] - L * rates["token_steps_per_s"]) <= 1e-9 * rates["layer_steps_per_s"]
    assert rates["prefill_tokens"] == 16 and rates["jumps_per_token_step"] == 0
    assert "[rates] 16 token steps" in r.output and "layer steps/s (L = 2)" in r.output
    layers = report["layers"]
    assert len(layers["prefill_s"]) == len(layers["decode_s"]) == L
    assert layers["decode_steps"] == 16 and layers["prompt_tokens"] == 64  # each new token enters the state
    assert all(t > 0 for t in layers["prefill_s"] + layers["decode_s"])
    assert sum(layers["prefill_s"]) + sum(layers["decode_s"]) <= layers["timed_s"]  # the blocks lie inside the run
    assert "[layers]" in r.output


def test_an_unknown_section_is_named():
    r = CliRunner().invoke(cli, ["bench", "--sections", "rates,speed", "--no-references"])
    assert r.exit_code == 2 and "section 'speed'" in r.output and "layers" in r.output
