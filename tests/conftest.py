"""Run the longest test files first.

The suite runs on two xdist workers (setup.cfg). When a test of minutes starts last, one worker runs it alone while
the other has nothing left: started first, the short tests fill in around it. Only the order changes, never what a
test checks. The list is the files that took longest on the 2-core CI host (`--durations=0`); a file not listed
keeps its place after them.
"""

from __future__ import annotations

import pytest

LONGEST_FIRST = (
    "trainer/test_async_training.py",
    "trainer/test_recipe_errors.py",
    "trainer/test_recipe.py",
    "workers/test_rollout.py",
    "workers/test_actor.py",
    "trainer/test_agent_recipe.py",
    "agents/test_harness.py",
    "trainer/test_recovery.py",
    "models/test_loading.py",
    "trainer/test_explain.py",
    "trainer/test_env_sources_recipe.py",
    "trainer/test_lora_recipe.py",
    "models/test_parallelize.py",
    "utils/test_checkpoint.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}

    def key(item: pytest.Item) -> int:
        path = item.path.as_posix()
        return next((i for name, i in rank.items() if path.endswith("tests/" + name)), len(rank))

    items.sort(key=key)  # stable: each file keeps its own order
