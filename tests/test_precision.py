"""--precision: load_model's reduced paths where users are (CLI, server, traces), and `auto`.

References: the float32 model (teacher-forced greedy agreement over 200 positions), the GGUF
file's own tensor types (what `auto` must pick), and the recorded trace (replay).
"""

import json

import pytest
import torch
from click.testing import CliRunner

from hybridlm import load_model
from hybridlm.cli import cli
from hybridlm.errors import InputError
from hybridlm.lm.linear import Linear
from hybridlm.lm.quantize import Int4Linear, agreement
from hybridlm.weights.gguf_header import read_header
from hybridlm.weights.loading import file_precision

TEXT = ("The history of the Roman Empire spans many centuries. It began when Augustus became the first "
        "emperor, after a long civil war, and it ended in the west when the last emperor was deposed. The "
        "empire built roads, aqueducts and cities, and its law and language shaped Europe for a thousand years. "
        "In the east, the empire lived on with Constantinople as its capital, trading silk and spices, until the "
        "city fell in the fifteenth century. Historians still argue about why the western half collapsed: some "
        "blame the economy, others the army, the climate, disease, or the pressure of peoples on the borders. ")


@pytest.fixture(scope="module")
def int4():
    return load_model(precision="auto")


def test_auto_picks_the_files_grid(smollm2, int4):
    kinds = [t.kind.name for t in read_header(smollm2.gguf_path).tensors if len(t.shape) == 2]
    assert kinds.count("Q4_1") > len(kinds) / 2  # the embedded file's matrices are Q4_1
    assert file_precision(smollm2.gguf_path) == "int4" and int4.precision == "int4"
    assert smollm2.precision == "float32"
    assert load_model("random:gpt2", precision="auto").precision == "float32"


def test_int4_keeps_no_float32_copy_of_the_layers(int4, smollm2):
    assert not any(isinstance(m, Linear) for m in int4.modules())
    assert sum(isinstance(m, Int4Linear) for m in int4.modules()) > 0

    def nbytes(model):
        seen = {}
        for t in [*model.parameters(), *model.buffers()]:
            if t is not None:
                seen[t.data_ptr()] = t.numel() * t.element_size()
        return sum(seen.values())

    # the layers' float32 weights are gone; what stays float32 is the embedding (read row by row)
    assert nbytes(int4) < 0.45 * nbytes(smollm2), (nbytes(int4), nbytes(smollm2))


def test_int4_agrees_with_float32_on_200_teacher_forced_positions(int4, smollm2):
    ids = smollm2.tokenizer.encode(TEXT * 2)[:201]
    assert len(ids) == 201
    result = agreement(int4, smollm2, ids)
    assert result["positions"] == 201 and result["agreement"] >= 0.99, result


def test_bad_precision_is_one_line():
    with pytest.raises(InputError, match="precision 'int3'"):
        load_model(precision="int3")
    r = CliRunner().invoke(cli, ["generate", "hi", "--precision", "int3"])
    assert r.exit_code == 2 and "int3" in r.output and len(r.output.strip().splitlines()) == 1, r.output


def test_the_trace_records_the_precision_and_replay_uses_it(tmp_path):
    trace = tmp_path / "arc.jsonl"
    r = CliRunner().invoke(cli, ["agent", "What is 12 * 13?", "--trace", str(trace), "--max-new-tokens", "60"])
    assert r.exit_code == 0, r.output
    start = json.loads(trace.read_text().splitlines()[0])
    assert start["event"] == "start" and start["precision"] == "int4"
    r = CliRunner().invoke(cli, ["trace", "replay", str(trace)])
    assert r.exit_code == 0 and "identical" in r.output, r.output
    r = CliRunner().invoke(cli, ["models", "--json"])
    rows = {row["name"]: row for row in json.loads(r.output)}
    assert rows["smollm2-135m"]["precision"] == "int4" and rows["random:gpt2"]["precision"] == "float32"


def test_a_batch_of_int4_rows_gives_each_its_tokens_alone(int4):
    from hybridlm.engine import Engine, Kernel
    from hybridlm.engine.clock import sequence

    tok = int4.tokenizer
    prompts = [tok.encode(p) for p in ("Once upon a time", "The sea is", "Numbers: 1, 2,")]

    def run(indices):
        engine = Engine(int4)
        seqs = [engine.add(sequence(int4, prompts[i], kernel=Kernel(temperature=1.0), max_new_tokens=12, seed=i))
                for i in indices]
        engine.run()
        return {i: s.arc.tokens for i, s in zip(indices, seqs)}

    together = run([0, 1, 2])
    for i in range(3):
        assert run([i])[i] == together[i]
    with torch.no_grad():
        assert int4(torch.tensor([prompts[0]])).dtype == torch.float32


def test_built_quantised_equals_quantised_after_loading(int4, smollm2):
    from hybridlm.lm.quantize import set_precision

    after = set_precision(load_model(), "int4")
    ids = torch.tensor([smollm2.tokenizer.encode(TEXT)[:64]])
    with torch.no_grad():
        assert torch.equal(int4(ids), after(ids))


def test_int4_loads_without_holding_the_float32_model():
    """Peak resident memory of a fresh process loading each precision (the float32 weights are
    540 MB; int4 is built from the cache one tensor at a time)."""
    import subprocess
    import sys

    def peak(precision: str) -> int:  # VmHWM, kB: ru_maxrss would carry this test process's peak across exec
        code = ("from hybridlm import load_model; load_model(precision=%r); "
                "print(open('/proc/self/status').read().split('VmHWM:')[1].split()[0])" % precision)
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
        return int(out.split()[-1])

    f32, q4 = peak("float32"), peak("int4")
    assert q4 < f32 - 150 * 1024, (q4, f32)  # at least 150 MiB less at the peak
