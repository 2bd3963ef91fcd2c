"""Fixtures of the dspark drafter's tests: a tiny lfm2_moe target and DSpark drafters in the published layout."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

# the target's builders live with the lfm2 family's tests; this distribution depends on that family anyway
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tensorfold_lfm2" / "tests"))

from dspark_helpers import plain_replies, shipped_pair, tiny_dspark_checkpoint  # noqa: E402
from lfm2_helpers import tiny_lfm2_checkpoint  # noqa: E402


@pytest.fixture(scope="session")
def target_dir(tmp_path_factory):
    return tiny_lfm2_checkpoint(tmp_path_factory.mktemp("lfm2-moe-target"), moe=True)


@pytest.fixture(scope="session")
def dspark_dir(tmp_path_factory, target_dir):
    """A random DSpark drafter for the target: its drafts mostly miss."""
    return tiny_dspark_checkpoint(tmp_path_factory.mktemp("dspark") / "tiny-dspark", target_dir)


@pytest.fixture(scope="module")
def pair():
    with shipped_pair() as loaded:
        yield loaded


@pytest.fixture(scope="module")
def plain(pair):
    return plain_replies(pair[0])
