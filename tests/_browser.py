"""A real headless browser for the dashboard tests: Debian's
chromium-headless-shell driven by Playwright (PyPI), with no network.

Playwright's own browser download cannot work here and is not needed: the
browser is the system's (``apt-get install chromium-headless-shell``; .ci/run
installs it). Without it the browser tests skip, unless
DTRALLOC_REQUIRE_BROWSER is set (CI sets it), where they fail instead.
"""
from __future__ import annotations

import contextlib
import os
import shutil

import pytest

CHROMIUM = os.environ.get("DTRALLOC_CHROMIUM", "/usr/bin/chromium-headless-shell")


def available() -> str:
    """'' when a browser can be launched, else why not."""
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "playwright is not installed (pip install '.[test]')"
    if not (os.path.exists(CHROMIUM) or shutil.which(CHROMIUM)):
        return f"{CHROMIUM} is missing (apt-get install -y --no-install-recommends chromium-headless-shell)"
    return ""


def require() -> None:
    """Skips the calling test module (called at module level) when no browser
    can be launched, or fails it where DTRALLOC_REQUIRE_BROWSER is set."""
    why = available()
    if why:
        if os.environ.get("DTRALLOC_REQUIRE_BROWSER"):
            pytest.fail(f"DTRALLOC_REQUIRE_BROWSER is set but {why}")
        pytest.skip(why, allow_module_level=True)


@contextlib.contextmanager
def launch():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            yield browser
        finally:
            browser.close()
