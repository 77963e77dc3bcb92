"""What every tier needs. Tier fixtures live in tests/<tier>/conftest.py, helpers in
tests/support/."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import settings

# Property tests check what the code computes, not how fast: under a loaded CI machine
# hypothesis's default 200 ms deadline per example fails correct code.
settings.register_profile("suite", deadline=None)
settings.load_profile("suite")


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    """Keep each phase's report on the test item (``item.rep_call``), so a fixture can
    tell in its teardown whether the test failed (and show the agents' logs)."""
    report = yield
    setattr(item, f"rep_{report.when}", report)
    return report
