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
    """Start the selected tests' long scripts (their module's EARLY) beside the others: early.py."""
    for item in items:
        entry = getattr(getattr(item, "module", None), "EARLY", {}).get(getattr(item, "name", None))
        if entry is not None:
            early.start(*entry)


def pytest_sessionfinish(session, exitstatus):
    early.stop()


@pytest.fixture
def one_thread():
    """One torch thread for the test (tiny shapes run fastest so), the setting restored after it."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
