import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(ROOT, "tests", "data")

import early  # noqa: E402 (tests/ on the path first)


@pytest.hookimpl(trylast=True)  # after -k and -m have deselected
def pytest_collection_modifyitems(config, items):
    """Start the selected tests' long interpreter scripts (their module's EARLY) side by side: early.py."""
    for item in items:
        script = getattr(getattr(item, "module", None), "EARLY", {}).get(getattr(item, "name", None))
        if script is not None:
            early.start(script, item.module.ENV)


def pytest_sessionfinish(session, exitstatus):
    early.stop()
