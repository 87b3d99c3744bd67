"""The architecture: every module imports, no import cycles, and imports point down the layers.

Edges are read from the source (every `import` and `from … import`, at module level and
inside functions alike, since a lazy import still ties two modules together). Importing
`a.b.c` also runs the package `a.b`, so an edge to a module is an edge to its packages
too (all but the root facade `hybridlm`, which every import passes through once, and the
importer's own packages, which are already running).
"""

import ast
import importlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1] / "src" / "hybridlm"

# Lower layers first; a module may import its own layer and the ones below, never above.
LAYERS = [
    ("hybridlm.errors", "hybridlm.cache", "hybridlm.memory", "hybridlm.figures", "hybridlm._lazy"),
    ("hybridlm.alphabet", "hybridlm.chat_template", "hybridlm.tokenizer", "hybridlm.files"),
    ("hybridlm.lm",),
    ("hybridlm.ssm",),
    ("hybridlm.weights",),
    ("hybridlm.engine",),
    ("hybridlm.control", "hybridlm.constraints", "hybridlm.plant", "hybridlm.tools"),
    ("hybridlm.turns", "hybridlm.analysis", "hybridlm.optimal"),
    ("hybridlm.report",),
    ("hybridlm.agent", "hybridlm.server"),
    ("hybridlm.distributed",),
    ("hybridlm.bench", "hybridlm.cli"),
]
# Rooms of one floor that stand side by side: neither imports the other (the agent and the server
# both compose the tool-calling turn of the floor below; a chat request never climbs into the agent).
APART = [("hybridlm.agent", "hybridlm.server")]


def modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def imported(name: str, path: Path, known: set[str]) -> set[str]:
    """The hybridlm modules `name` imports (resolved to modules, not attributes)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for target in targets:
            if not target.startswith("hybridlm"):
                continue
            while target not in known:  # an attribute of a module: the module
                target = target.rpartition(".")[0]
            found.add(target)
            parts = target.split(".")
            for i in range(2, len(parts)):  # the packages it runs, but the root and our own (running already)
                parent = ".".join(parts[:i])
                if not (name + ".").startswith(parent + "."):
                    found.add(parent)
    found.discard(name)
    return found


def graph() -> dict[str, set[str]]:
    mods = modules()
    return {name: imported(name, path, set(mods)) for name, path in mods.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, on, stack, out, counter = {}, {}, set(), [], [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10_000)
    for v in edges:
        if v not in index:
            visit(v)
    return out


def layer(name: str) -> int | None:
    for i, group in enumerate(LAYERS):
        if any(name == g or name.startswith(g + ".") for g in group):
            return i
    return None


def test_no_import_cycles():
    assert cycles(graph()) == []


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_every_module_has_a_layer_and_imports_point_down():
    edges = graph()
    unplaced = sorted(n for n in edges if n != "hybridlm" and layer(n) is None)
    assert unplaced == [], f"modules outside LAYERS: {unplaced}"
    upward = sorted(f"{a} → {b}" for a, targets in edges.items() if a != "hybridlm"
                    for b in targets if layer(b) is not None and layer(b) > layer(a))
    assert upward == []


def test_rooms_side_by_side_import_nothing_of_each_other():
    edges = graph()

    def within(name: str, room: str) -> bool:
        return name == room or name.startswith(room + ".")

    crossing = sorted(f"{a} → {b}" for a, targets in edges.items() for b in targets for left, right in APART
                      if (within(a, left) and within(b, right)) or (within(a, right) and within(b, left)))
    assert crossing == []


def test_only_the_facade_imports_the_facade():
    edges = graph()
    assert [n for n, targets in edges.items() if "hybridlm" in targets] == []


@pytest.mark.parametrize("name", sorted(modules()))
def test_every_module_imports(name):
    importlib.import_module(name)


def test_importing_the_library_leaves_the_process_alone():
    """No malloc or huge-page settings change on `import hybridlm`: those are the CLI's and the bench's."""
    code = ("import os, hybridlm, hybridlm.agent, hybridlm.control; "
            "print(os.environ.get('THP_MEM_ALLOC_ENABLE'), __import__('hybridlm.memory').memory.configured)")
    env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.split() == ["None", "False"]


@pytest.mark.parametrize("argv, thp", [(["generate", "--help"], "1"), (["serve", "--help"], "None")])
def test_the_server_leaves_huge_page_allocation_off(argv, thp):
    """The CLI's settings, except for `serve`: 2 MiB-aligned tensors of every size fragment a
    long-running process's heap (the server's resident size grew with every request)."""
    code = ("import os, sys; from hybridlm import cli; sys.argv = ['hybridlm', *sys.argv[1:]]\n"
            "try:\n    cli.main()\nexcept SystemExit:\n    pass\n"
            "print(os.environ.get('THP_MEM_ALLOC_ENABLE'), file=sys.stderr)")
    env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    out = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, env=env, check=True)
    assert out.stderr.split()[-1] == thp


NOQA = re.compile(r"#\s*noqa\b(?::\s*[A-Z]+[0-9]+(?:\s*,\s*[A-Z]+[0-9]+)*)?(?P<why>.*)$")


def test_every_noqa_says_why_on_its_line():
    """A rule switched off is switched off for a reason, written beside it."""
    bare = []
    for path in sorted(ROOT.rglob("*.py")):
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            m = NOQA.search(line)
            if m is not None and not re.search(r"[a-z]{2}", m.group("why")):
                bare.append(f"{path.relative_to(ROOT.parent)}:{number}")
    assert bare == []


def test_the_noqa_check_finds_a_bare_one():
    assert not re.search(r"[a-z]{2}", NOQA.search("x = 1  # noqa: E731").group("why"))
    assert re.search(r"[a-z]{2}", NOQA.search("x = 1  # noqa: E731, B007 - a reason").group("why"))


def test_the_code_cites_the_theory_page_and_its_sections_exist():
    """Citations point into the repository (docs/theory.md), never to files outside it, and every
    section cited there is one of the page's headings."""
    theory = (ROOT.parents[1] / "docs" / "theory.md").read_text(encoding="utf-8")
    sections = set(re.findall(r"^#+ (§\d+(?:\.\d+)?) ", theory, re.M))
    outside, missing = [], []
    for path in sorted(p for p in ROOT.rglob("*") if p.suffix in (".py", ".c", ".h")):
        text = path.read_text(encoding="utf-8")
        where = path.relative_to(ROOT.parent)
        outside += [f"{where}: {m}" for m in re.findall(r"SPEC\.md|seed 00\d", text)]
        for cited in re.findall(r"docs/theory\.md\s+((?:§\d+(?:\.\d+)?(?:–|, | and )?)+)", text):
            missing += [f"{where}: {s}" for s in re.findall(r"§\d+(?:\.\d+)?", cited) if s not in sections]
    assert outside == [] and missing == []
    assert {"§2", "§3", "§4", "§5.3", "§7"} <= sections
