"""The `hybridlm` command line: one module per command group, their shared options in `options`."""

from __future__ import annotations

import sys

import click

from hybridlm.cli.agent import agent
from hybridlm.cli.bench import bench
from hybridlm.cli.consensus import consensus, sweep
from hybridlm.cli.evaluate import eval_group
from hybridlm.cli.generate import generate
from hybridlm.cli.models import models
from hybridlm.cli.options import Group
from hybridlm.cli.report import report
from hybridlm.cli.serve import serve
from hybridlm.cli.steer import steer
from hybridlm.cli.survey import survey
from hybridlm.cli.trace import trace


@click.group(cls=Group)
@click.version_option(package_name="hybridlm")
def cli() -> None:
    """Decoder-only language models as explicit hybrid dynamical systems."""


for command in (agent, bench, consensus, eval_group, generate, models, report, serve, steer, survey, sweep, trace):
    cli.add_command(command)


def main() -> None:
    from hybridlm.memory import configure

    command = next((a for a in sys.argv[1:] if not a.startswith("-")), None)
    configure(long_running=command == "serve")  # the process is ours (see hybridlm.memory)
    cli(prog_name="hybridlm")
