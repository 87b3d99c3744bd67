"""`hybridlm agent --stream` and the live progress line (hybridlm.agent.watch).

Reference: the arc itself (its token ids, decoded by the tokenizer turn by turn, and its jumps)
for what the stream wrote; a terminal stand-in for the progress line.
"""

import io
import json

from click.testing import CliRunner

from hybridlm.agent import HybridAgent, Limits
from hybridlm.agent.watch import Progress
from hybridlm.cli import cli
from hybridlm.tools import registry

TASK = "What is 5230 minus 148?"


def test_stream_writes_every_turn_and_jump_as_the_arc_holds_them(smollm2):
    r = CliRunner().invoke(cli, ["agent", TASK, "--stream", "--json", "-n", "60"], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    arc = json.loads(r.stdout)
    assert arc["jumps"], "the task makes a call"
    tok, stops = smollm2.tokenizer, set(smollm2.tokenizer.stop_ids())
    ids, expected, at = arc["generated_ids"], "", 0
    for j in arc["jumps"]:
        expected += tok.decode([i for i in ids[at:j["t"]] if i not in stops])
        expected += f"\n[jump {j['k']}: {j['tool']}({json.dumps(j['arguments'])}) → {j['observation']}]\n"
        at = j["t"]
    expected += tok.decode([i for i in ids[at:] if i not in stops]) + "\n"
    assert r.stderr.startswith(expected), (r.stderr, expected)
    assert "\r" not in r.stderr  # no progress line beside the stream


def test_progress_is_one_line_in_place_and_off_without_a_terminal(smollm2):
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    out = Terminal()
    agent = HybridAgent(smollm2, registry(["calculator"]), limits=Limits(max_token_steps=40, max_jumps=1))
    arc = agent.run(TASK, observers=(Progress(out, every_s=0.0),))
    lines = out.getvalue().split("\r")
    shown = [line.strip() for line in lines if line.strip()]
    assert "\n" not in out.getvalue() and shown[0].startswith("t=0 k=0")
    assert shown[-1].startswith(f"t={arc.token_steps} k={len(arc.jumps)}")
    assert out.getvalue().endswith("\r") and not lines[-2].strip()  # cleared at the end
    r = CliRunner().invoke(cli, ["agent", TASK, "-n", "8"], catch_exceptions=False)  # stderr is no terminal here
    assert r.exit_code == 0 and "\r" not in r.stderr
