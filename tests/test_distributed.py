"""Shards on a Ray cluster of two nodes, started here on loopback, give the local numbers.

The reference is the local run of the same configuration in this process
(`run_consensus`, `evaluate`): the cluster's CSV must equal it byte for byte, through
uneven shards, killed workers and interrupted sweeps.
"""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridlm.agent.evaluation import evaluate
from hybridlm.analysis import runner as R
from hybridlm.distributed import consensus as DC
from hybridlm.distributed import LocalPool, load_sweep, map_shards, run_consensus_sharded, run_sweep
from hybridlm.distributed.sweep import run_name

torch.set_num_threads(1)

@pytest.fixture(scope="module")
def cluster():
    """Two Ray nodes of one CPU each on 127.0.0.1, shut down at the end of the module."""
    from hybridlm.distributed.cluster import local_cluster

    with local_cluster(nodes=2, cpus_per_node=1, object_store_mb=80) as c:
        yield c


@pytest.fixture(scope="module")
def ray_pool(cluster):
    import ray

    from hybridlm.distributed import RayPool

    assert len([n for n in ray.nodes() if n["Alive"]]) == 2
    return RayPool(ray, max_retries=2)


def local_run(cfg, folder) -> Path:
    """The reference: the local run, on the thread count of a Ray worker of one CPU (one).

    The BLAS's sums may depend on the thread count (MKL on an AMD host splits the inner
    dimension of a 40×1536 · 1536×576 product on two threads), so equality to the last digit
    is between runs on equal thread counts; docs/distributed.md says so."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        R.run_consensus(cfg, folder, progress=False)
    finally:
        torch.set_num_threads(threads)
    return Path(folder)


def same_files(a: Path, b: Path) -> None:
    """The two run folders hold the same CSV (to the byte), summary and checkpoint states."""
    assert (a / "consensus.csv").read_bytes() == (b / "consensus.csv").read_bytes()
    assert json.loads((a / "summary.json").read_text()) == json.loads((b / "summary.json").read_text())
    from safetensors.torch import load_file

    assert torch.equal(load_file(a / R.CHECKPOINT)["h"], load_file(b / R.CHECKPOINT)["h"])
    assert (a / "consensus.png").stat().st_size > 1000 and (b / "consensus.png").stat().st_size > 1000
    assert not (b / "shards").exists()


# ---------------------------------------------------------------------- without a cluster
@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 40), a=st.integers(0, 39), size=st.integers(1, 40), seed=st.integers(0, 2**31))
def test_a_prompt_depends_on_its_index_alone(n, a, size, seed):
    """The law sharding rests on: prompts a..b-1 of a run are the same rows whatever is drawn with them."""

    class Vocab:
        class config:
            vocab_size = 50257

    a = min(a, n - 1)
    b = min(a + size, n)
    cfg = R.ConsensusConfig(model="m", prompts=n, prompt_len=7, seed=seed)
    g = torch.Generator().manual_seed(seed)
    everything = torch.randint(0, 50257, (n, 7), generator=g)  # the whole run's prompts, drawn at once
    assert torch.equal(R.prompt_ids(Vocab, cfg, a, b), everything[a:b])


def test_local_shards_join_into_the_local_run(tmp_path, toy_hub):
    """Uneven shards in this process, every weights mode: the local run's files, byte for byte."""
    for weights in ("pretrained", "random-fixed", "random-redrawn"):
        cfg = R.ConsensusConfig(model=str(toy_hub[0]), weights=weights, prompts=5, prompt_len=9, passes=3, seed=4)
        ref = local_run(cfg, tmp_path / f"local-{weights}")
        run_consensus_sharded(cfg, tmp_path / f"shards-{weights}", pool=LocalPool(), shard_prompts=2)
        same_files(ref, tmp_path / f"shards-{weights}")


def test_sharded_run_continues_a_local_one_to_more_passes(tmp_path, toy_hub):
    cfg = R.ConsensusConfig(model=str(toy_hub[0]), weights="random-fixed", attention_only=True, prompts=4,
                            prompt_len=8, passes=4, seed=1)
    ref = local_run(cfg, tmp_path / "ref")
    short = R.ConsensusConfig(**{**cfg.__dict__, "passes": 2})
    local_run(short, tmp_path / "grown")
    run_consensus_sharded(cfg, tmp_path / "grown", pool=LocalPool(), shard_prompts=3)
    same_files(ref, tmp_path / "grown")
    other = R.ConsensusConfig(**{**cfg.__dict__, "seed": 2})
    with pytest.raises(Exception, match="another configuration"):
        run_consensus_sharded(other, tmp_path / "grown", pool=LocalPool(), shard_prompts=3)


def square_all(offset, shard):
    return [offset + i * i for i, _ in shard]


def test_map_shards_keeps_order_and_resumes_from_saved_shards(tmp_path):
    calls = []

    def record(shard, out):
        calls.append([i for i, _ in shard])

    store = tmp_path / "store"
    assert map_shards(square_all, list("abcdefg"), pool=LocalPool(), shard_size=3, args=(1,)) == [1, 2, 5, 10, 17, 26, 37]

    class Stop(Exception):
        pass

    def stop_after_first(shard, out):
        record(shard, out)
        raise Stop

    with pytest.raises(Stop):
        map_shards(square_all, list("abcdefg"), pool=LocalPool(), shard_size=3, args=(1,), store=store, key={"k": 1},
                   on_shard=stop_after_first)
    assert sorted(p.name for p in store.iterdir()) == ["000000-000003.json"]
    calls.clear()
    out = map_shards(square_all, list("abcdefg"), pool=LocalPool(), shard_size=3, args=(1,), store=store,
                     key={"k": 1}, on_shard=record)
    assert out == [1, 2, 5, 10, 17, 26, 37] and calls == [[3, 4, 5], [6]] and not store.exists()


def write_spec(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_sweep_spec_errors_are_one_line_with_exit_code_2(tmp_path):
    from hybridlm.cli import cli

    cases = {
        "grid:\n  - {model: m, prompts: [2, 3], colour: red}\n": "unknown key 'colour'",
        "grid:\n  - {model: m, prompts: two}\n": "prompts = 'two': expected int",
        "grid:\n  - {model: m, weights: random}\n": "--weights 'random'",
        "grid:\n  - {model: m, attention_only: 1}\n": "attention_only = 1: expected true or false",
        "grid: []\n": "grid: expected a list",
        "grid:\n  - {prompts: 3}\n": "no model",
        "grid: [\n": "not YAML",
        "kind: bfcl\ngrid:\n  - {model: m}\n": "kind 'bfcl'",
    }
    for i, (text, message) in enumerate(cases.items()):
        spec = write_spec(tmp_path / f"s{i}.yaml", text)
        r = CliRunner().invoke(cli, ["sweep", str(spec), "--out", str(tmp_path / "out")])
        assert r.exit_code == 2 and message in r.output and len(r.output.strip().splitlines()) == 1, (text, r.output)
    spec = write_spec(tmp_path / "ok.yaml", "grid:\n  - {model: m}\n")
    r = CliRunner().invoke(cli, ["sweep", str(spec), "--out", str(tmp_path / "out"), "--scale", "small"])
    assert r.exit_code == 2 and "--scale 'small'" in r.output
    r = CliRunner().invoke(cli, ["consensus", "--out", str(tmp_path / "c"), "--shard-prompts", "4"])
    assert r.exit_code == 2 and "--ray" in r.output


def test_the_survey_spec_covers_every_case_of_figs_6_to_9():
    spec = Path(__file__).parents[1] / "sweeps" / "survey_consensus.yaml"
    survey = load_sweep(spec)
    cases = {(r.config.model, r.config.weights, r.config.attention_only): r for r in survey.runs}
    L = {"gpt2-xl": 48, "gpt-neo-2.7b": 32}
    axis = {"6": 500, "7": 250, "8": 2000, "9": 2000}  # the figures' layer-step axes
    expected = {("6", "pretrained", True), ("7", "pretrained", False), ("8", "random-fixed", True),
                ("8", "random-fixed", False), ("9", "random-redrawn", True), ("9", "random-redrawn", False)}
    for fig, weights, attention_only in expected:
        for shape, depth in L.items():
            model = shape if weights == "pretrained" else f"random:{shape}"
            run = cases[(model, weights, attention_only)]
            assert fig in run.figures
            assert (run.config.prompts, run.config.prompt_len) == (100, 200)
            assert run.config.passes * depth >= axis[fig]
    assert len(survey.runs) == 12
    small = load_sweep(spec, "small")
    assert {fig for r in small.runs for fig in r.figures} == {"6", "7", "8", "9"}
    assert all(r.config.prompts * r.config.prompt_len <= 256 for r in small.runs)


def test_local_sweep_writes_runs_figures_and_record(tmp_path, toy_hub):
    spec = write_spec(tmp_path / "s.yaml", f"""
base: {{model: "{toy_hub[0]}", prompts: 3, prompt_len: 8, passes: 2}}
figures: {{a: "the first figure"}}
grid:
  - {{figure: a, weights: [pretrained, random-fixed], attention_only: [false, true]}}
  - {{figure: [a, b], weights: pretrained, attention_only: false}}
""")
    sweep = load_sweep(spec)
    assert len(sweep.runs) == 4  # the second entry repeats a run of the first
    record = run_sweep(sweep, tmp_path / "out", LocalPool())
    assert set(record["figures"]) == {"a", "b"}
    for fig in record["figures"].values():
        assert (tmp_path / "out" / fig).stat().st_size > 1000
    for r in record["runs"]:
        cfg = R.ConsensusConfig(**r["config"])
        ref = local_run(cfg, tmp_path / "ref" / run_name(cfg))
        assert (ref / "consensus.csv").read_bytes() == (tmp_path / "out" / r["folder"] / "consensus.csv").read_bytes()


def test_without_ray_nothing_imports_ray(tmp_path, toy_hub):
    spec = write_spec(tmp_path / "s.yaml", f'grid:\n  - {{model: "{toy_hub[0]}", prompts: 2, prompt_len: 4, passes: 1}}\n')
    code = f"""
import sys
from hybridlm.cli import cli
for args in (["consensus", "--model", {str(toy_hub[0])!r}, "--prompts", "2", "--prompt-len", "4", "--passes", "1",
              "--out", {str(tmp_path / "c")!r}],
             ["sweep", {str(spec)!r}, "--out", {str(tmp_path / "s")!r}],
             ["eval", "agent", "--n", "1", "--modes", "no-tools"]):
    cli(args, standalone_mode=False)
print("ray" in sys.modules)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "False"
    assert (tmp_path / "c" / "consensus.csv").exists() and (tmp_path / "s" / "sweep.json").exists()


def test_ray_options_without_ray_installed_name_the_extra(tmp_path):
    code = f"""
import sys
sys.modules["ray"] = None  # as if Ray were not installed: `import ray` raises ImportError
from hybridlm.cli import cli
cli(["consensus", "--model", "random:gpt2", "--ray", "--out", {str(tmp_path / "c")!r}], prog_name="hybridlm")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr[-2000:]
    assert out.stderr.strip().splitlines() == ["Error: --ray needs Ray. Ray is not installed: pip install 'hybridlm[ray]'"]


# ---------------------------------------------------------------------- on the cluster
def test_sweep_on_two_nodes_equals_the_local_runs(tmp_path, toy_hub, ray_pool):
    """Every weights mode, with and without the MLP, uneven shards, and one run of the real
    default model: the cluster's folders hold the local runs' files to the last digit."""
    spec = write_spec(tmp_path / "s.yaml", f"""
shard_prompts: 3
base: {{prompts: 7, prompt_len: 12, passes: 3, seed: 5}}
grid:
  - {{figure: toy, model: "{toy_hub[0]}", weights: [pretrained, random-fixed, random-redrawn], attention_only: [false, true]}}
  - {{figure: smollm2, model: smollm2-135m, prompts: 4, prompt_len: 10, passes: 1}}
""")
    sweep = load_sweep(spec)
    record = run_sweep(sweep, tmp_path / "ray", ray_pool)
    assert record["pool"]["nodes"] == 2
    nodes = {s["node"] for r in record["runs"] for s in r["shards"]}
    assert len(nodes) == 2  # the shards ran on both nodes
    assert [(s["start"], s["stop"]) for s in record["runs"][0]["shards"]] == [(0, 3), (3, 6), (6, 7)]
    for r in record["runs"]:
        cfg = R.ConsensusConfig(**r["config"])
        same_files(local_run(cfg, tmp_path / "local" / r["name"]), tmp_path / "ray" / r["folder"])


def strip_wall(value):
    """The report without its wall times, the one thing two runs may not share."""
    if isinstance(value, dict):
        return {k: strip_wall(v) for k, v in value.items() if "wall_s" not in k}
    if isinstance(value, list):
        return [strip_wall(v) for v in value]
    return value


def test_eval_agent_on_two_nodes_equals_the_local_report(tmp_path, smollm2, cluster):
    from hybridlm.cli import cli

    # (one mode: the shards and their merge are the same code for each; two shards of 3 problems)
    local = evaluate(smollm2, n=3, modes=("tools",))
    out = tmp_path / "report.json"
    r = CliRunner().invoke(cli, ["eval", "agent", "--n", "3", "--modes", "tools", "--ray", "--shard-size", "2",
                                 "--out", str(out)])
    assert r.exit_code == 0, r.output
    on_ray = json.loads(out.read_text())
    assert strip_wall(on_ray) == strip_wall(json.loads(json.dumps(local)))
    assert [row["index"] for row in on_ray["modes"]["tools"]["rows"]] == [0, 1, 2]
    assert not Path(f"{out}.shards").exists()


def shard_workers(cluster) -> list[int]:
    """Worker processes of this cluster running a consensus shard: children of its raylets
    whose title Ray set to the task's name."""
    raylets = {n.all_processes["raylet"][0].process.pid for n in [cluster.head_node, *cluster.worker_nodes]}
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            title = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0]
            ppid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        if ppid in raylets and title.strip() == b"ray::shard_task":
            found.append(int(pid))
    return found


def test_a_worker_killed_mid_shard_is_retried_and_the_result_is_identical(tmp_path, cluster, ray_pool):
    cfg = R.ConsensusConfig(model="random:gpt2", weights="random-fixed", prompts=4, prompt_len=16, passes=4, seed=3)
    killed: list[int] = []
    stop = threading.Event()

    def kill_one():
        deadline = time.monotonic() + 120
        while not stop.is_set() and time.monotonic() < deadline:
            workers = shard_workers(cluster)
            if workers:
                time.sleep(0.3)  # inside the shard (loading its model, or looping)
                os.kill(workers[0], signal.SIGKILL)
                killed.append(workers[0])
                return
            time.sleep(0.02)

    killer = threading.Thread(target=kill_one, daemon=True)
    killer.start()
    try:
        run_consensus_sharded(cfg, tmp_path / "ray", pool=ray_pool, shard_prompts=2)
    finally:
        stop.set()
        killer.join()
    assert killed, "no shard worker was seen to kill"
    assert not Path(f"/proc/{killed[0]}").exists()
    same_files(local_run(cfg, tmp_path / "local"), tmp_path / "ray")


def test_an_interrupted_sweep_restarts_from_its_finished_shards(tmp_path, toy_hub, ray_pool, monkeypatch):
    spec = write_spec(tmp_path / "s.yaml", f"""
shard_prompts: 2
base: {{model: "{toy_hub[0]}", prompts: 6, prompt_len: 10, passes: 4, weights: random-redrawn}}
grid:
  - {{attention_only: [false, true]}}
""")
    sweep = load_sweep(spec)
    real_add = DC.ShardedConsensus.add
    arrived = []

    def add_then_interrupt(self, result):
        real_add(self, result)
        arrived.append((self.cfg.attention_only, result.start))
        if len(arrived) == 3:
            raise KeyboardInterrupt

    monkeypatch.setattr(DC.ShardedConsensus, "add", add_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        run_sweep(sweep, tmp_path / "out", ray_pool)
    monkeypatch.setattr(DC.ShardedConsensus, "add", real_add)
    kept = list((tmp_path / "out").rglob("shards/*.safetensors"))
    assert len(kept) == 3  # each saved as it arrived; no run was finished (the third arrival interrupted)

    submitted = []
    real_jobs = DC.ShardedConsensus.jobs

    def counted_jobs(self):
        jobs = real_jobs(self)
        submitted.extend(jobs)
        return jobs

    monkeypatch.setattr(DC.ShardedConsensus, "jobs", counted_jobs)
    record = run_sweep(sweep, tmp_path / "out", ray_pool)
    assert len(submitted) == 6 - 3  # the three finished shards are not done again
    assert sum(s.get("kept", False) for r in record["runs"] for s in r["shards"]) == 3
    for r in record["runs"]:
        cfg = R.ConsensusConfig(**r["config"])
        same_files(local_run(cfg, tmp_path / "local" / r["name"]), tmp_path / "out" / r["folder"])


def test_cli_consensus_on_ray_equals_the_local_cli(tmp_path, toy_hub, cluster):
    from hybridlm.cli import cli

    args = ["consensus", "--model", str(toy_hub[0]), "--weights", "random-redrawn", "--attention-only", "--prompts", "5",
            "--prompt-len", "8", "--passes", "3", "--seed", "9", "--device", "cpu"]
    r = CliRunner().invoke(cli, [*args, "--out", str(tmp_path / "local")])
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(cli, [*args, "--out", str(tmp_path / "ray"), "--ray", "--shard-prompts", "2"])
    assert r.exit_code == 0, r.output
    same_files(tmp_path / "local", tmp_path / "ray")
    r = CliRunner().invoke(cli, ["consensus", "--model", "gpt7-ultra", "--out", str(tmp_path / "bad"), "--ray"])
    assert r.exit_code == 2 and "gpt7-ultra" in r.output and len(r.output.strip().splitlines()) == 1, r.output
