"""One ledger: admit, wait, keep, resume — held bytes never pass the budget, and every byte comes back."""

from __future__ import annotations

import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tensorfold_core.loading import start_drafter
from tensorfold_core.errors import RequestError
from tensorfold_core.host import Host
from tensorfold_core.lanes.types import DoneEvent, GenerationRequest, TokenEvent
from tensorfold_core.memory.ledger import GIB
from tensorfold_core.options import ServeOptions
from tensorfold_core.sampling import SamplingParams
from tensorfold_core.testing import array_bytes, loaded_tiny_pair


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return loaded_tiny_pair(tmp_path_factory.mktemp("memory"))


def make_host(pair, budget_bytes, *, drafted=True, prompt_cache_bytes=0, parallel=4):
    model, tokenizer, drafter_path = pair
    drafter = start_drafter(str(drafter_path), model, tokenizer) if drafted else None
    options = ServeOptions(parallel=parallel, memory_gib=budget_bytes / GIB, prompt_cache_gib=prompt_cache_bytes / GIB,
                           prefill_chunk=16)
    return Host(model, tokenizer, options, model_id="m", context=512, drafter=drafter,
                row_invariant=True, start=False)


class Driver:
    """Runs a host's engine inline: inbox, admission and rounds, checking the ledger after each step."""

    def __init__(self, host):
        self.host, self.events = host, {}

    def submit(self, request):
        events = []
        ticket = self.host.submit(request, events.append)
        self.events[ticket.id] = events
        return ticket

    def step(self):
        host = self.host
        host._drain_inbox()
        host._admit()
        self.check_real_bytes()
        host.engine.round()
        self.check_real_bytes()

    def check_real_bytes(self):
        """Held bytes stay in the budget, and what each stream really holds (its cache's and its drafter slot's
        arrays, growth included) stays within what admission reserved for it."""
        host = self.host
        ledger = host.ledger
        assert ledger.held() <= ledger.budget
        drafter = host.drafter
        for stream in host.engine.streams.values():
            assert array_bytes(stream.cache) <= ledger.reserved(("stream", stream.id))
            slot = drafter.slots.get(stream.id) if drafter is not None else None
            if slot is not None:
                assert array_bytes(slot.cache) <= ledger.reserved(("slot", stream.id))
        if drafter is not None:
            assert array_bytes([slot.cache for slot in drafter.kept]) <= ledger.reserved(("drafter", "kept"))

    def finish(self, limit=10_000):
        for _ in range(limit):
            if self.host.engine.idle() and not self.host.queued() and self.host._inbox.empty():
                return
            self.step()
        raise AssertionError("streams never finished")

    def tokens(self, ticket):
        return [t for e in self.events[ticket.id] if isinstance(e, TokenEvent) for t in e.token_ids]

    def done(self, ticket):
        return next(e for e in self.events[ticket.id] if isinstance(e, DoneEvent))


def test_two_requests_that_each_fit_alone_wait_for_each_other_and_pass_in_turn(pair):
    probe = make_host(pair, GIB)
    one = probe.admission.price(300)
    # room for one stream and one kept drafter slot, not for two streams
    host = make_host(pair, one + probe.admission.slot_bytes(300) + one // 4)
    driver = Driver(host)
    first = driver.submit(GenerationRequest(prompt_ids=list(range(10, 40)), max_tokens=270))
    second = driver.submit(GenerationRequest(prompt_ids=list(range(50, 70)), max_tokens=280))
    driver.step()
    assert len(host.engine.streams) == 1 and host.queued() == 1  # the second waits, it is not refused
    while host.queued():
        driver.step()
    assert host.ledger.by_kind().get("kept_drafter_slots", 0) > 0  # the second runs beside the first's slot
    driver.finish()
    assert driver.done(first).finish_reason == "length" and driver.done(second).finish_reason == "length"
    assert host.admission.waits == 1  # the second stream, once, however many loops it waited
    kinds = host.ledger.by_kind()
    assert kinds.get("stream_cache", 0) == 0 and kinds.get("drafter_slot", 0) == 0
    assert kinds.get("kept_drafter_slots", 0) > 0  # the first's slot stayed beside the second
    assert host.ledger.held() == kinds.get("kept_drafter_slots", 0) + kinds.get("kept_state", 0)


def test_a_request_that_can_never_fit_is_refused_at_once_with_the_numbers(pair):
    host = make_host(pair, 64 * 1024)
    with pytest.raises(RequestError, match=r"GiB") as refused:
        host.submit(GenerationRequest(prompt_ids=[5, 6, 7], max_tokens=400), lambda e: None)
    assert refused.value.status == 400 and refused.value.code == "memory_budget_exceeded"


def test_a_refusal_for_the_budget_names_bytes_and_the_max_tokens_that_would_fit(pair):
    probe = make_host(pair, GIB)
    host = make_host(pair, probe.admission.price(200))
    with pytest.raises(RequestError) as refused:
        host.submit(GenerationRequest(prompt_ids=[5, 6, 7], max_tokens=400), lambda e: None)
    message = str(refused.value)
    need = int(re.search(r"needs ([\d,]+) bytes", message).group(1).replace(",", ""))
    budget = int(re.search(r"budget of ([\d,]+) bytes", message).group(1).replace(",", ""))
    assert need > budget  # bytes, never two roundings that read equal
    fits = int(re.search(r"send max_tokens of at most (\d+)", message).group(1))
    host.submit(GenerationRequest(prompt_ids=[5, 6, 7], max_tokens=fits), lambda e: None)
    with pytest.raises(RequestError):
        host.submit(GenerationRequest(prompt_ids=[5, 6, 7], max_tokens=fits + 1), lambda e: None)


@settings(max_examples=20, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.lists(st.tuples(st.integers(1, 40), st.integers(1, 30), st.booleans(), st.integers(0, 6)),
                min_size=1, max_size=6),
       st.booleans(), st.integers(2, 5))
def test_held_bytes_never_pass_the_budget_and_all_come_back(pair, arrivals, drafted, budget_streams):
    probe = make_host(pair, GIB, drafted=drafted)
    budget = probe.admission.price(70) * budget_streams
    host = make_host(pair, budget, drafted=drafted, prompt_cache_bytes=budget // 3)
    driver = Driver(host)
    tickets = []
    for prompt_len, max_tokens, sampled, cancel_after in arrivals:
        sampling = SamplingParams(temperature=0.8, seed=prompt_len) if sampled else SamplingParams()
        tickets.append((driver.submit(GenerationRequest(prompt_ids=[9 + i % 50 for i in range(prompt_len)],
                                                        max_tokens=max_tokens, sampling=sampling)), cancel_after))
        driver.step()
        for ticket, after in tickets:
            if after and len(driver.tokens(ticket)) >= after:
                host.cancel(ticket)
    driver.finish()
    kinds = host.ledger.by_kind()
    assert kinds.get("stream_cache", 0) == 0 and kinds.get("drafter_slot", 0) == 0
    assert host.ledger.held() == kinds.get("kept_state", 0) + kinds.get("kept_drafter_slots", 0)
    assert all(any(isinstance(e, DoneEvent) for e in driver.events[t.id]) for t, _ in tickets)
