"""The GPU check's shards (tools/gpu/steps.py): ``-m gpu_check --gpu-shard NAME`` keeps
the tests marked ``@pytest.mark.gpu_check("NAME")`` (``NAME,NAME``: those of each; the dry
run's one process); a ``gpu_check`` mark without one shard name is a collection error
naming the fix. Loaded by tests/conftest.py."""

from __future__ import annotations

import pytest


def pytest_addoption(parser):
    parser.addoption("--gpu-shard", default=None, metavar="NAME[,NAME...]",
                     help="keep only the tests marked gpu_check(NAME) (the GPU check's shard; "
                          "several, comma-separated: those of each)")


def shard_of(item) -> str | None:
    mark = item.get_closest_marker("gpu_check")
    if mark is None:
        return None
    if len(mark.args) != 1 or not isinstance(mark.args[0], str) or mark.kwargs:
        raise pytest.UsageError(
            f"{item.nodeid}: @pytest.mark.gpu_check takes one shard name, e.g. "
            f"gpu_check(\"ops\") (tools/gpu/steps.py: CUDA_SHARDS, GRAPHS_SHARD); got "
            f"args {mark.args} kwargs {mark.kwargs}")
    return mark.args[0]


def pytest_collection_modifyitems(config, items):
    want = config.getoption("--gpu-shard")
    if want is None:
        return
    shards = set(want.split(","))
    keep = [item for item in items if shard_of(item) in shards]
    drop = [item for item in items if shard_of(item) not in shards]
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
