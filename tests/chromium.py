"""Debian's chromium, headless, driven by playwright: the one browser the tests open pages in (never a
browser that playwright downloads; CI installs it, .ci/run)."""

import contextlib
from pathlib import Path

import pytest

CHROMIUM = "/usr/bin/chromium"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run"]


@contextlib.contextmanager
def launched(profile: Path, *args: str, **options):
    """A browser context with its profile in `profile`, chromium's flags plus `args`; a missing chromium is
    a failure, named."""
    if not Path(CHROMIUM).exists():
        pytest.fail(f"{CHROMIUM} is missing: apt-get install -y chromium (the browser pages are tested in)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        context = p.chromium.launch_persistent_context(str(profile), executable_path=CHROMIUM, headless=True,
                                                       args=[*FLAGS, *args], **options)
        yield context
        context.close()
