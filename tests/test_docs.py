"""The README and docs/ against the code: the README stays a newcomer's page, its commands parse
with the command line as it is (the quick ones run), its Python imports exist, every relative
link of the docs reaches a file, and the trace schema exists once (any copy equal to it)."""

import ast
import importlib
import re
import shlex
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from hybridlm.cli import cli
from hybridlm.engine.trace import SCHEMA_PATH

ROOT = Path(__file__).parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def blocks(text: str, language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", text, re.S)


def readme_commands() -> list[list[str]]:
    """Every `hybridlm …` command of the README's shell blocks, as argv (comments and && chains split)."""
    out = []
    for block in blocks(README, "sh"):
        for line in block.splitlines():
            line = re.sub(r"\s+#.*$", "", line)
            for part in line.split("&&"):
                words = shlex.split(part)
                if words[:1] == ["hybridlm"]:
                    out.append(words[1:])
    return out


def resolve(argv: list[str]) -> click.Context:
    """The context click builds for argv, down the command groups: every option and value is
    parsed and converted, nothing runs."""
    ctx = cli.make_context("hybridlm", list(argv))
    command: click.Command = cli
    while isinstance(command, click.Group):
        rest = [*ctx._protected_args, *ctx.args]
        name, command, rest = command.resolve_command(ctx, rest)
        ctx = command.make_context(name, rest, parent=ctx)
    return ctx


def test_the_readme_is_a_newcomers_page():
    lines = README.splitlines()
    assert len(lines) <= 260
    assert lines[0] == "# hybridlm" and "docs/theory.md" in README
    test = [line for line in lines if re.match(r"^python3 -m venv .* -m pytest", line)]
    assert len(test) == 1 and "-mno-amx-tile" in test[0] and "CMAKE_ARGS" in README
    words = " ".join(README.split())  # (the titles may wrap)
    assert "Deep learning from a control vantage point" in words and "Unified Hybrid Framework" in words


def test_the_readme_shows_commands():
    assert len(readme_commands()) >= 8


@pytest.mark.parametrize("argv", readme_commands(), ids=lambda argv: " ".join(argv)[:60])
def test_every_readme_command_parses(argv, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # outputs named by a command are checked (made) where it would run
    ctx = resolve(argv)
    assert ctx.command.callback is not None


def test_the_readme_generate_commands_run(toy_hub, tmp_path, monkeypatch):
    """Run on a small model of the hub layout: the README's commands as written, plus --model."""
    monkeypatch.chdir(tmp_path)
    commands = [argv for argv in readme_commands() if argv[0] == "generate"]
    assert commands
    for argv in commands:
        r = CliRunner().invoke(cli, [*argv, "--model", str(toy_hub[0]), "-n", "4"])
        assert r.exit_code == 0, (argv, r.output)


def test_the_readme_python_imports_exist():
    for block in blocks(README, "python"):
        for node in ast.walk(ast.parse(block)):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("hybridlm"):
                module = importlib.import_module(node.module)
                for alias in node.names:
                    assert hasattr(module, alias.name), f"{node.module}.{alias.name}"


def test_every_relative_link_of_the_docs_reaches_a_file():
    broken = []
    for page in PAGES:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text(encoding="utf-8")):
            if "://" not in target and not (page.parent / target).exists():
                broken.append(f"{page.relative_to(ROOT)} → {target}")
    assert broken == []


def test_the_trace_schema_exists_once():
    """The docs link to the package's schema; a copy anywhere in the repository would have to equal it."""
    schema = SCHEMA_PATH.read_bytes()
    copies = [p for p in ROOT.rglob("trace.schema.json") if ".git" not in p.parts and p.resolve() != SCHEMA_PATH]
    assert all(p.read_bytes() == schema for p in copies)
    assert "../src/hybridlm/engine/trace.schema.json" in (ROOT / "docs" / "trace.md").read_text(encoding="utf-8")
