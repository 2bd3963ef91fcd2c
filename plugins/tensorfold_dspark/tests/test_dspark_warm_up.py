"""A server's warm-up with a DSpark drafter: its holds re-timed after the cold ones, and no lane left behind."""

from __future__ import annotations

from tensorfold_core.checkpoint import Checkpoint
from tensorfold_core.lanes.warm_up import warm_up
from tensorfold_core.loading import start_drafter
from tensorfold_lfm2.load import load


def test_a_warm_up_re_times_the_drafters_holds_and_leaves_no_lane_no_kept_context_and_no_counts(target_dir,
                                                                                              dspark_dir):
    target = load(Checkpoint.open(target_dir))
    drafter = start_drafter(str(dspark_dir), target, Checkpoint.open(target_dir).tokenizer())
    try:
        timed_at_start = drafter.holds
        report = warm_up(target, prefill_chunk=16, context=256, shared_rounds=True, drafter=drafter)
        assert report.rounds > 0
        assert drafter.holds is not timed_at_start and drafter.holds.timed
        assert not drafter.lanes and not drafter.kept
        assert not any(drafter.stats.values()), drafter.stats
    finally:
        drafter.close()
