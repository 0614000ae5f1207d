"""The planner's tests trace into a disk cache of their own (`torchrlhf.plan.trace_cache`), never the user's."""

from __future__ import annotations

import os

import pytest

from torchrlhf.plan.trace_cache import ENV


@pytest.fixture(scope="session", autouse=True)
def _own_plan_cache(tmp_path_factory):
    before = os.environ.get(ENV)
    os.environ[ENV] = str(tmp_path_factory.mktemp("plan_cache"))
    yield
    if before is None:
        os.environ.pop(ENV, None)
    else:
        os.environ[ENV] = before
