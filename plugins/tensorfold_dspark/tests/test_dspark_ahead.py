"""Holds queued before the host reads the verify (TENSORFOLD_HOLD_AHEAD=1): the lane absorbs the window's rows and
the block starts from the device's bonus draw, so the drafts equal an in-step hold's and the replies plain decoding."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from tensorfold_core.host import Host
from tensorfold_core.kernels import KERNELS_ENV
from tensorfold_core.lanes.engine import HOLD_AHEAD_ENV, Engine
from tensorfold_core.loading import start_drafter
from tensorfold_core.lanes.warm_up import WARM_UP_ENV
from tensorfold_core.options import ServeOptions
from tensorfold_core.protocols import HELD_ENV
from tensorfold_core.testing import Run, drive, served_by_thread
from tensorfold_dspark.drafter import DSparkDrafter
from tensorfold_dspark.kernels.block_attention_streams import mlx_block_streams

from dspark_helpers import NAME, requests


@pytest.fixture
def ahead(monkeypatch):
    monkeypatch.setenv(HOLD_AHEAD_ENV, "1")


@pytest.fixture
def compared(monkeypatch):
    """Each queued hold a stream takes, beside the hold its lane would run in step at that depth: [(queued, in step)]."""
    pairs = []
    take = DSparkDrafter._take_ahead

    def take_and_compare(self, ask, depth, drafts, i):
        queued = self._ahead.get(ask.stream_id)
        taken = take(self, ask, depth, drafts, i)
        if taken:
            steps, _, _ = self._hold([ask.tokens], [self.lanes[ask.stream_id]], [len(queued.drafts)])
            pairs.append((queued.drafts.read(), [step[0] for step in steps]))
        return taken

    monkeypatch.setattr(DSparkDrafter, "_take_ahead", take_and_compare)
    return pairs


def test_the_drafter_says_it_can_hold_ahead_and_the_engine_does_only_when_asked(pair, monkeypatch):
    target, drafter = pair
    assert drafter.facts.hold_ahead
    monkeypatch.delenv(HOLD_AHEAD_ENV, raising=False)
    assert not Engine(target.model, drafter=drafter).holds_ahead  # off until timed on a GPU
    monkeypatch.setenv(HOLD_AHEAD_ENV, "1")
    assert Engine(target.model, drafter=drafter).holds_ahead
    assert not Engine(target.model, drafter=None).holds_ahead


@pytest.mark.parametrize("parallel", [1, 4])
def test_queued_holds_draft_what_in_step_holds_draft_and_the_replies_equal_plain_decoding(pair, plain, ahead, compared,
                                                                                         parallel):
    target, drafter = pair
    before = dict(drafter.stats)
    assert drive(target.model, drafter, requests(target, False), parallel, timed=False) == plain[False]
    used = drafter.stats["ahead_used"] - before["ahead_used"]
    assert used > 10 and drafter.stats["ahead"] - before["ahead"] >= used
    assert len(compared) == used
    assert all(queued == in_step for queued, in_step in compared)  # draft for draft, on the CPU


def test_lanes_fed_by_queued_holds_hold_the_rows_in_step_lanes_hold(pair, monkeypatch):
    target, drafter = pair
    lanes = {}
    for on in ("0", "1"):
        monkeypatch.setenv(HOLD_AHEAD_ENV, on)
        drafter.shed_kept()
        used = drafter.stats["ahead_used"]
        drive(target.model, drafter, requests(target, False), 1, timed=False)
        assert (drafter.stats["ahead_used"] - used >= 10) == (on == "1")
        lanes[on] = {tuple(lane.tokens): (lane.n, lane.spans, [k[..., :lane.n, :] for k in lane.keys + lane.values])
                     for lane in drafter.kept}  # each stream's lane, kept at its release
    assert lanes["0"].keys() == lanes["1"].keys() and len(lanes["0"]) >= 4
    compared_rows = 0
    for tokens, (n, spans, rows) in lanes["0"].items():
        n_ahead, spans_ahead, rows_ahead = lanes["1"][tokens]
        # a queued hold absorbs its window's rows at once, an in-step one at the stream's next hold, and the runs'
        # holds drafted to other depths: the lanes end at other lengths, the rows both hold are the same
        both = min(n, n_ahead)
        assert both > 0 and spans == [(0, n)] and spans_ahead == [(0, n_ahead)]
        assert all(mx.array_equal(a[..., :both, :], b[..., :both, :]).item() for a, b in zip(rows, rows_ahead))
        compared_rows += both
    assert compared_rows >= 64


def test_seeded_streams_hold_in_step_and_their_replies_equal_plain_decoding(pair, plain, ahead):
    target, drafter = pair
    queued = drafter.stats["ahead"]
    assert drive(target.model, drafter, requests(target, True), 4, timed=False) == plain[True]
    assert drafter.stats["ahead"] == queued  # a seeded row's draw is the host's, not the device's argmax


def test_greedy_streams_beside_seeded_ones_hold_ahead_and_every_reply_equals_plain_decoding(pair, plain, ahead):
    target, drafter = pair
    greedy, seeded = requests(target, False), requests(target, True)
    mixed = [greedy[i] if i % 2 else seeded[i] for i in range(len(greedy))]
    want = [plain[False][i] if i % 2 else plain[True][i] for i in range(len(greedy))]
    before = dict(drafter.stats)
    assert drive(target.model, drafter, mixed, 4, timed=False) == want
    assert drafter.stats["ahead_used"] - before["ahead_used"] > 5
    assert drafter.stats["ahead_missed"] == before["ahead_missed"]  # the host's greedy draws are the device's


def test_holds_queued_on_drafts_held_on_the_device_give_replies_equal_to_plain_decoding(pair, plain, ahead,
                                                                                       monkeypatch):
    target, drafter = pair
    monkeypatch.setenv(HELD_ENV, "1")
    held = start_drafter(NAME, target.model, target.tokenizer)  # the facts are read at start
    try:
        assert held.facts.held_on_target and held.facts.hold_ahead
        assert drive(target.model, held, requests(target, False), 4, timed=False) == plain[False]
        assert held.stats["ahead_used"] > 0
    finally:
        held.close()
        target.model.features(drafter.model.args.target_layer_ids)  # close() untapped the shared target


def test_streams_joining_and_a_cancelled_neighbour_change_no_reply_while_holds_run_ahead(pair, plain):
    target, drafter = pair
    reqs = requests(target, False)
    run = Run(target.model, 3)
    run.engine = Engine(target.model, prefill_chunk=8, drafter=drafter, timed=False, hold_ahead=True)
    used = drafter.stats["ahead_used"]
    run.submit(0, reqs[0])
    for _ in range(6):
        run.step()
    run.submit(1, reqs[1])
    run.submit(2, reqs[2])
    for _ in range(6):
        run.step()
    run.engine.cancel(2)  # its queued hold, if any, goes with its lane
    run.submit(3, reqs[3])
    run.submit(4, reqs[7])
    run.finish()
    assert run.done(2).finish_reason == "cancelled" and drafter.stats["ahead_used"] > used
    for sid, ref in [(0, 0), (1, 1), (3, 3), (4, 7)]:
        assert run.tokens(sid) == plain[False][ref], f"stream {sid}"


SHORTER_THAN_SPEC = []  # blocks whose row map's n was below their spec's: queued ones, their rejected rows masked


def lengths_from_the_rowmap(q, context_keys, context_values, blocks, rowmap, block_keys, block_values, scale):
    """The streams kernels' contract, on the host: each block over its lane's n as its row map holds it, not as the
    host's spec says (MLX's composed call reads the spec)."""
    n = np.array(rowmap)[:, 1]
    read = tuple((start, count, int(n[start]) if count else lanes_n, size) for start, count, lanes_n, size in blocks)
    SHORTER_THAN_SPEC.extend(1 for a, b in zip(read, blocks) if a[2] < b[2])
    return mlx_block_streams(q, context_keys, context_values, read, rowmap, block_keys, block_values, scale)


def test_where_the_streams_kernels_read_lengths_from_the_row_map_queued_blocks_take_them_and_draft_as_in_step(
        pair, plain, ahead, compared, monkeypatch):
    target, _ = pair
    monkeypatch.setenv(KERNELS_ENV, "records")
    served = start_drafter(NAME, target.model, target.tokenizer)
    try:
        assert served.model.streams_rowmap is not None and not served.model.rowmap_lengths  # mlx: the spec's n
        for layer in served.model.layers:  # as cuda's and metal's kernels read it
            layer.self_attn.attend_streams = lengths_from_the_rowmap
        object.__setattr__(served.model, "rowmap_lengths", True)
        assert drive(target.model, served, requests(target, False), 4, timed=False) == plain[False]
        assert served.stats["ahead_used"] > 10 and len(compared) == served.stats["ahead_used"]
        assert SHORTER_THAN_SPEC  # queued blocks' device lengths, read from their row maps
        assert all(queued == in_step for queued, in_step in compared)
    finally:
        served.close()
        target.model.features(pair[1].model.args.target_layer_ids)


@pytest.mark.parametrize("on", ["0", "1"])
def test_a_server_says_whether_its_holds_run_ahead_and_answers_as_plain_decoding_either_way(pair, plain, monkeypatch,
                                                                                          on):
    target, _ = pair
    monkeypatch.setenv(HOLD_AHEAD_ENV, on)
    monkeypatch.setenv(WARM_UP_ENV, "0")
    drafter = start_drafter(NAME, target.model, target.tokenizer)
    host = Host(target.model, target.tokenizer, ServeOptions(parallel=4, memory_gib=1.0, prompt_cache_gib=0),
                model_id="m", context=512, drafter=drafter, row_invariant=True)
    try:
        assert host.capabilities()["holds_ahead"] is (on == "1")
        assert [served_by_thread(host, r) for r in requests(target, False)[:3]] == plain[False][:3]
        if on == "0":  # on, whether holds are queued is the timed guards' call (the untimed runs above show them)
            assert drafter.stats["ahead"] == 0
    finally:
        host.close()
        target.model.features(pair[1].model.args.target_layer_ids)


def test_a_hold_queued_on_a_draw_the_host_does_not_make_is_never_taken_and_the_lane_stays_whole(pair, plain, ahead,
                                                                                                 monkeypatch):
    import tensorfold_core.lanes.engine as engine_module

    target, drafter = pair
    made = engine_module.device_acceptance
    monkeypatch.setattr(engine_module, "device_acceptance",
                        lambda drafts, draws: (made(drafts, draws)[0], made(drafts, draws)[1] + 1))
    before = dict(drafter.stats)
    assert drive(target.model, drafter, requests(target, False), 4, timed=False) == plain[False]
    assert drafter.stats["ahead_used"] == before["ahead_used"]
    assert drafter.stats["ahead_missed"] - before["ahead_missed"] == drafter.stats["ahead"] - before["ahead"] > 0
