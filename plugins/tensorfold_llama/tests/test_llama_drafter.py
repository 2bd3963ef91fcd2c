"""The llama drafter: greedy chains equal to its serial decode, slots synced by prefix, admission, warm-up."""

from __future__ import annotations

import gc
import json
import random
import shutil
import weakref

import mlx.core as mx
import pytest

from tensorfold_core.checkpoint import Checkpoint
from tensorfold_core.errors import DrafterError, OptionError
from tensorfold_core.options import ServeOptions
from tensorfold_core.plugins import Registry, new_plugin_manager
from tensorfold_core.protocols import DraftAsk
from tensorfold_core.loading import check_same_tokenizer
from tensorfold_core.specs import DrafterOptions, LoadOptions
from tensorfold_core.testing import PROMPT, copy_checkpoint, write_tokenizer
from tensorfold_llama import drafter as drafter_module
from tensorfold_llama import plugin
from tensorfold_core.tokenizer import tokenizer_difference
from tensorfold_llama.drafter import LlamaDrafter, admit, start
from tensorfold_llama.load import load
from tensorfold_llama.model import Model

TARGET_VOCAB, DRAFTER_VOCAB = 384, 448
NO_EOS = DrafterOptions(eos_ids=[])  # random weights say eos often enough to shorten chains the tests compare


def contexts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(TARGET_VOCAB) for _ in range(rng.randrange(1, 40))] for _ in range(n)]


@pytest.fixture(scope="module")
def target(checkpoints):
    return load(Checkpoint.open(checkpoints("gqa-tied")))


@pytest.fixture(scope="module")
def drafter_dir(checkpoints):
    """A llama of another seed whose embedding is padded past the shared tokenizer (448 rows for 384 ids)."""
    return checkpoints("drafter-448", seed=1, vocab_size=DRAFTER_VOCAB)


@pytest.fixture(scope="module")
def drafter_4bit_dir(quantized, drafter_dir):
    path = quantized("drafter-448", 4, 64)
    for name in ("tokenizer.json", "tokenizer_config.json"):  # mlx-lm rewrites them: keep the originals
        shutil.copy(drafter_dir / name, path / name)
    return path


@pytest.fixture(params=["float32", "4-bit"])
def drafter_ckpt(request, drafter_dir, drafter_4bit_dir):
    return Checkpoint.open(drafter_dir if request.param == "float32" else drafter_4bit_dir)


def serial(model: Model, context: list[int], depth: int, limit: int = TARGET_VOCAB, eos=()) -> list[int]:
    """The drafter's own greedy decode from scratch, one token at a time, ids past `limit` masked."""
    cache, logits = model.new_cache(len(context) + depth + 1), None
    for token in context:
        logits = model.forward([cache], [[token]], [1])
        model.keep(cache, 1)
    out = []
    for _ in range(depth):
        out.append(mx.argmax(logits[0, :limit]).item())
        if out[-1] in eos:
            break
        logits = model.forward([cache], [[out[-1]]], [1])
        model.keep(cache, 1)
    return out


def test_the_llama_plugin_registers_a_llama_drafter_for_llama_and_mistral_checkpoints(drafter_dir, tmp_path):
    pm = new_plugin_manager(entry_points=False)
    pm.register(plugin)
    (kind,) = Registry(pm).drafters()
    assert kind.name == "llama" and kind.matches(Checkpoint.open(drafter_dir))
    other = copy_checkpoint(drafter_dir, tmp_path / "lfm2")
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "model_type": "lfm2"}))
    assert not kind.matches(Checkpoint.open(other))
    assert "llama" in [d.name for d in Registry(new_plugin_manager()).drafters()]


def test_the_drafter_is_a_proposer_and_its_drafts_equal_its_own_serial_greedy_decode(target, drafter_ckpt):
    drafter = start(target, drafter_ckpt, NO_EOS)
    assert drafter.name == "llama" and callable(drafter.propose) and callable(drafter.release)
    for i, context in enumerate(contexts(6)):
        assert drafter.propose([DraftAsk(i, context, 15)]) == [serial(drafter.model, context, 15)]


def test_an_accepted_draft_costs_no_second_pass(target, drafter_dir):
    drafter = start(target, Checkpoint.open(drafter_dir), NO_EOS)
    context = PROMPT[:12]
    (drafts,) = drafter.propose([DraftAsk(7, context, 4)])
    assert drafter.stats["rows"] == 12 + 3  # the context, then one row for each chained step
    grown = context + drafts + [99]  # all four drafts accepted, then the target's bonus token
    before = drafter.stats["rows"]
    assert drafter.propose([DraftAsk(7, grown, 4)]) == [serial(drafter.model, grown, 4)]
    # only the last draft (never fed back) and the bonus token are new rows: the accepted three are cached
    assert drafter.stats["rows"] - before == 2 + 3


def test_a_rejected_draft_is_cut_from_the_slot_and_the_next_proposal_equals_a_fresh_drafters(target, drafter_dir):
    ckpt = Checkpoint.open(drafter_dir)
    drafter = start(target, ckpt, NO_EOS)
    context = PROMPT[:12]
    (drafts,) = drafter.propose([DraftAsk(7, context, 6)])
    rejected = next(t for t in range(TARGET_VOCAB) if t != drafts[1])
    grown = context + drafts[:1] + [rejected]  # the first draft accepted, the second replaced by the target's draw
    before = drafter.stats["rows"]
    proposal = drafter.propose([DraftAsk(7, grown, 6)])
    assert drafter.stats["rows"] - before == 1 + 5  # only the target's token is fed: the slot was cut to the prefix
    assert proposal == start(target, ckpt, NO_EOS).propose([DraftAsk(1, grown, 6)])
    assert drafter.slots[7].tokens[:len(grown)] == grown


def test_several_streams_proposed_in_one_call_equal_their_lone_proposals(target, drafter_ckpt):
    depths = [15, 3, 0, 9, 1]
    asks = [DraftAsk(i, context, depth) for i, (context, depth) in enumerate(zip(contexts(5, seed=3), depths))]
    lone = [start(target, drafter_ckpt, NO_EOS).propose([ask])[0] for ask in asks]
    shared = start(target, drafter_ckpt, NO_EOS)
    assert shared.propose(asks) == lone
    assert [len(d) for d in lone] == depths
    # and again a round later, each stream having accepted a different share of its drafts
    later = [DraftAsk(a.stream_id, list(a.tokens) + d[:i] + [5], 4) for i, (a, d) in enumerate(zip(asks, lone))]
    assert shared.propose(later) == [serial(shared.model, list(a.tokens), 4) for a in later]


def test_one_propose_call_evaluates_the_whole_proposal_once(target, drafter_dir, monkeypatch):
    drafter = start(target, Checkpoint.open(drafter_dir), NO_EOS)
    calls, real_eval = [], mx.eval
    monkeypatch.setattr(drafter_module.mx, "eval", lambda *a: (calls.append(1), real_eval(*a))[1])
    drafter.propose([DraftAsk(i, context, 12) for i, context in enumerate(contexts(4))])
    assert len(calls) == 1 and drafter.stats["forwards"] == 12  # the first windows, then 11 chained steps


def test_a_chain_stops_at_an_eos_of_the_targets_tokenizer(target, drafter_dir):
    ckpt = Checkpoint.open(drafter_dir)
    assert start(target, ckpt).eos_ids == frozenset(ckpt.tokenizer().eos_ids) == {0}
    model = load(ckpt)
    def first_new(chain):  # where the chain first says a token it has not said yet
        return next((k for k, t in enumerate(chain) if k and t not in chain[:k]), len(chain))

    context, full = min(((c, serial(model, c, 15)) for c in contexts(20)), key=lambda cs: first_new(cs[1]))
    stop = first_new(full)
    assert stop < 14  # the chain goes on past the eos unless it stops there
    drafter = start(target, ckpt, DrafterOptions(eos_ids=[full[stop]]))
    assert drafter.propose([DraftAsk(0, context, 15)]) == [full[:stop + 1]]


def test_a_chain_is_at_most_fifteen_deep(target, drafter_dir):
    drafter = start(target, Checkpoint.open(drafter_dir), NO_EOS)
    assert [len(d) for d in drafter.propose([DraftAsk(0, PROMPT, 40), DraftAsk(1, PROMPT[:3], 15)])] == [15, 15]
    assert len(start(target, Checkpoint.open(drafter_dir), NO_EOS.replace(max_depth=4)).propose(
        [DraftAsk(0, PROMPT, 15)])[0]) == 4
    with pytest.raises(OptionError, match="max_depth 16"):
        DrafterOptions(max_depth=16)


def test_a_released_slot_is_adopted_by_a_new_stream_sharing_its_prefix(target, drafter_dir):
    drafter = start(target, Checkpoint.open(drafter_dir), NO_EOS.replace(max_kept=2))
    (drafts,) = drafter.propose([DraftAsk(1, PROMPT, 5)])
    drafter.release(1)
    assert drafter.kept_bytes() > 0 and drafter.slot_bytes() == 0
    follow_up = PROMPT + drafts[:3] + [42, 43]  # a later turn: the old reply, then new text
    before = drafter.stats["rows"]
    assert drafter.propose([DraftAsk(2, follow_up, 5)]) == [serial(drafter.model, follow_up, 5)]
    assert drafter.stats["slot_reuses"] == 1 and drafter.kept == []
    assert drafter.stats["rows"] - before == 2 + 4  # only the new text is read
    drafter.propose([DraftAsk(3, [7, 8, 9], 2)])  # nothing shared: a fresh slot
    assert drafter.stats["slot_reuses"] == 1


def test_kept_slots_are_capped_and_the_oldest_give_way_first(target, drafter_dir):
    drafter = start(target, Checkpoint.open(drafter_dir), NO_EOS.replace(max_kept=2))
    firsts = [[11], [12], [13]]
    for i, context in enumerate(firsts):
        drafter.propose([DraftAsk(i, context + [1, 2], 2)])
        drafter.release(i)
    assert [slot.tokens[0] for slot in drafter.kept] == [12, 13]
    assert drafter.kept_bytes() == 2 * drafter.model.cache_bytes(drafter.kept[0].cache.capacity)
    assert drafter.shed_kept(1) > 0 and [slot.tokens[0] for slot in drafter.kept] == [13]
    drafter.propose([DraftAsk(9, [11, 1, 2, 3], 2)])  # the oldest is gone: no reuse
    assert drafter.stats["slot_reuses"] == 0
    assert DrafterOptions.serving(ServeOptions(parallel=3)).max_kept == 3


def test_a_slot_is_made_at_its_admitted_size_and_never_grows_while_its_stream_decodes(target, drafter_dir):
    drafter = start(target, Checkpoint.open(drafter_dir), NO_EOS)
    context, limit = (PROMPT * 20)[:250], 270
    drafter.propose([DraftAsk(0, context[:20], 3, limit=limit)])
    cache = drafter.slots[0].cache
    shapes = [a.shape for a in cache.keys + cache.values]
    assert drafter.slot_bytes() == drafter.slot_bytes_for(limit)
    assert drafter.propose([DraftAsk(0, context, 15, limit=limit)]) == [serial(drafter.model, context, 15)]
    assert drafter.slots[0].cache is cache and [a.shape for a in cache.keys + cache.values] == shapes
    assert drafter.slot_bytes() == drafter.slot_bytes_for(limit) == sum(a.nbytes for a in cache.keys + cache.values)


def test_a_kept_slot_of_another_size_is_copied_into_one_of_the_new_streams_size(target, drafter_dir):
    drafter = start(target, Checkpoint.open(drafter_dir), NO_EOS.replace(max_kept=2))
    (drafts,) = drafter.propose([DraftAsk(1, PROMPT, 5, limit=len(PROMPT) + 8)])
    drafter.release(1)
    follow_up, limit = PROMPT + drafts[:3] + [42, 43], 700
    assert drafter.propose([DraftAsk(2, follow_up, 5, limit=limit)]) == [serial(drafter.model, follow_up, 5)]
    assert drafter.stats["slot_reuses"] == 1 and drafter.slot_bytes() == drafter.slot_bytes_for(limit)


def test_where_caches_come_in_size_classes_a_kept_slot_of_the_new_streams_class_is_adopted_as_it_is(target,
                                                                                                     drafter_dir):
    from tensorfold_core.row_kernels.modules import KeyCompiled

    drafter = start(target, Checkpoint.open(drafter_dir), NO_EOS.replace(max_kept=2))
    # as on a GPU, where a whole forward's trace is keyed by its caches' shapes (this CPU's forward never reads it)
    drafter.model.whole, drafter.model.whole_spans = KeyCompiled(), False
    (drafts,) = drafter.propose([DraftAsk(1, PROMPT, 5, limit=2400)])  # a slot of 2,560 tokens
    drafter.release(1)
    kept = drafter.kept[0].cache
    follow_up, limit = PROMPT + drafts[:3] + [42, 43], 2100  # 2,304 tokens asked: in the same class
    assert drafter.propose([DraftAsk(2, follow_up, 5, limit=limit)]) == [serial(drafter.model, follow_up, 5)]
    assert drafter.slots[2].cache is kept and kept.capacity == 2560  # not copied into a cache of the same size
    assert drafter.slot_bytes() == drafter.slot_bytes_for(limit)


def test_a_padded_drafter_vocab_never_yields_an_id_past_the_targets_vocab(target, drafter_dir, tmp_path):
    loud = copy_checkpoint(drafter_dir, tmp_path / "loud")
    tensors = mx.load(str(loud / "model.safetensors"))
    embed = tensors["model.embed_tokens.weight"]  # tied: louder padded rows win the unmasked argmax
    tensors["model.embed_tokens.weight"] = mx.concatenate([embed[:TARGET_VOCAB], 3 * embed[TARGET_VOCAB:]])
    mx.save_safetensors(str(loud / "model.safetensors"), tensors, metadata={"format": "pt"})
    drafter = start(target, Checkpoint.open(loud), NO_EOS)
    asks = [DraftAsk(i, context, 15) for i, context in enumerate(contexts(6))]
    unmasked = [serial(drafter.model, list(a.tokens), 15, limit=DRAFTER_VOCAB) for a in asks]
    assert any(t >= TARGET_VOCAB for chain in unmasked for t in chain)
    drafts = drafter.propose(asks)
    assert all(t < TARGET_VOCAB for chain in drafts for t in chain) and all(len(d) == 15 for d in drafts)


def test_a_context_the_drafter_cannot_embed_gets_no_drafts(target, drafter_dir):
    drafter = start(target, Checkpoint.open(drafter_dir), NO_EOS)
    assert drafter.propose([DraftAsk(0, [5, DRAFTER_VOCAB + 1], 4), DraftAsk(1, [5], 2)])[0] == []


@pytest.fixture
def edited(drafter_dir, tmp_path):
    """A copy of the drafter whose tokenizer files an edit changes."""
    path = copy_checkpoint(drafter_dir, tmp_path / "edited")

    def edit(file: str, change) -> Checkpoint:
        data = json.loads((path / file).read_text())
        change(data)
        (path / file).write_text(json.dumps(data))
        return Checkpoint.open(path)

    return path, edit


def test_a_drafter_retrained_with_another_vocab_is_refused_naming_the_first_token_that_differs(
        target, checkpoints, edited):
    path, _ = edited
    write_tokenizer(path, vocab_size=300)
    target_tokenizer = Checkpoint.open(checkpoints("gqa-tied")).tokenizer()
    with pytest.raises(DrafterError, match=r"edited does not share the target's tokenizer: token id 300: "
                                           r"target '.+' vs drafter no token"):
        check_same_tokenizer(target_tokenizer, Checkpoint.open(path))


@pytest.mark.parametrize("file, change, message", [
    ("tokenizer.json", lambda t: t["model"]["merges"].insert(17, t["model"]["merges"].pop(18)),
     r"merges differ at merge 17: target '.+ .+' vs drafter '.+ .+'"),
    ("tokenizer.json", lambda t: t["model"]["vocab"].update({"<|mask|>": 999}),
     r"token id 5: target '<\|mask\|>' vs drafter no token"),
    ("tokenizer.json", lambda t: t["added_tokens"][4].update(special=False),
     r"added token id 4 \('<\|im_end\|>'\): special True vs False"),
    ("tokenizer_config.json", lambda c: c.update(eos_token="<|im_end|>"), r"eos ids differ: \[0\] vs \[0, 4\]"),
    ("tokenizer_config.json", lambda c: c.update(bos_token="<|pad|>"), r"bos ids differ: 1 vs 2"),
])
def test_a_drafter_whose_tokenizer_differs_is_refused_naming_the_first_difference(
        target, checkpoints, edited, file, change, message):
    _, edit = edited
    target_tokenizer = Checkpoint.open(checkpoints("gqa-tied")).tokenizer()
    with pytest.raises(DrafterError, match=message):
        check_same_tokenizer(target_tokenizer, edit(file, change))


def test_a_drafter_with_the_targets_tokenizer_and_padded_vocab_is_admitted(target, checkpoints, drafter_dir):
    tokenizer = Checkpoint.open(checkpoints("gqa-tied")).tokenizer()
    assert tokenizer_difference(tokenizer.fingerprint(), Checkpoint.open(drafter_dir).tokenizer().fingerprint()) is None
    check_same_tokenizer(tokenizer, Checkpoint.open(drafter_dir))
    admit(target, Checkpoint.open(drafter_dir))


def test_drafter_bits_that_do_not_match_the_checkpoint_are_refused(target, drafter_dir, drafter_4bit_dir):
    dense, packed = Checkpoint.open(drafter_dir), Checkpoint.open(drafter_4bit_dir)
    for ckpt, bits in ((dense, 0), (dense, None), (packed, 4), (packed, None)):
        admit(target, ckpt, bits)
    with pytest.raises(DrafterError, match="--drafter-bits 4: drafter-448 holds float32 weights; pass "
                                           "--drafter-bits 0 or a 4-bit checkpoint"):
        admit(target, dense, 4)
    with pytest.raises(DrafterError, match="--drafter-bits 0: drafter-448-q4g64 holds 4-bit weights; pass "
                                           "--drafter-bits 4 or a float checkpoint"):
        admit(target, packed, 0)
    with pytest.raises(DrafterError, match="--drafter-bits 8: drafter-448-q4g64 holds 4-bit weights"):
        admit(target, packed, 8)
    with pytest.raises(DrafterError, match="--drafter-bits 3: expected 0"):
        admit(target, packed, 3)


def test_a_bfloat16_drafter_runs_in_bfloat16_and_stays_exact(target, drafter_dir):
    drafter = start(target, Checkpoint.open(drafter_dir), NO_EOS.replace(dtype="bfloat16"))
    assert drafter.model.dtype == mx.bfloat16
    reference = load(Checkpoint.open(drafter_dir), LoadOptions(dtype="bfloat16"))
    assert drafter.propose([DraftAsk(0, PROMPT, 10)]) == [serial(reference, PROMPT, 10)]


def test_a_failed_warm_up_frees_the_drafter_and_raises_a_drafter_error(target, drafter_dir, monkeypatch):
    refs, warm_up = [], LlamaDrafter.warm_up

    def watched(self):
        refs.extend([weakref.ref(self), weakref.ref(self.model)])
        return warm_up(self)

    def broken(self, *args, **kwargs):
        raise RuntimeError("the forward failed")

    monkeypatch.setattr(LlamaDrafter, "warm_up", watched)
    monkeypatch.setattr(Model, "forward_ids", broken)
    with pytest.raises(DrafterError, match="drafter-448: warm-up failed .RuntimeError: the forward failed.") as caught:
        start(target, Checkpoint.open(drafter_dir))
    gc.collect()
    assert len(refs) == 2 and all(ref() is None for ref in refs)  # the drafter and its weights, while the error lives
    assert isinstance(caught.value.__cause__, RuntimeError)


def test_a_proposal_that_fails_drops_its_streams_slots_and_the_next_one_starts_afresh(target, drafter_dir, monkeypatch):
    drafter = start(target, Checkpoint.open(drafter_dir), NO_EOS)
    drafter.propose([DraftAsk(0, PROMPT[:10], 4), DraftAsk(1, PROMPT[:4], 4)])
    def lost(*args, **kwargs):
        raise RuntimeError("device lost")

    with monkeypatch.context() as patch:
        patch.setattr(Model, "forward_ids", lost)
        with pytest.raises(RuntimeError, match="device lost"):
            drafter.propose([DraftAsk(0, PROMPT[:12], 4)])
    assert list(drafter.slots) == [1]
    assert drafter.propose([DraftAsk(0, PROMPT[:12], 4)]) == [serial(drafter.model, PROMPT[:12], 4)]


def test_a_catch_up_feeds_lagging_slots_apart_and_leaves_the_proposal_unchanged(target, drafter_dir):
    ckpt = Checkpoint.open(drafter_dir)
    caught, plain = start(target, ckpt, NO_EOS), start(target, ckpt, NO_EOS)
    asks = [DraftAsk(i, context, 6) for i, context in enumerate(contexts(3, seed=7))]
    lagging = sum(len(a.tokens) - 1 for a in asks if len(a.tokens) > 3)
    assert caught.catch_up(asks) == lagging
    assert caught.propose(asks) == plain.propose(asks)
    # a stream a step behind (its drafts accepted) is not caught up apart: its rows stay in the chain's forward
    grown = [DraftAsk(a.stream_id, list(a.tokens) + d + [5], 6) for a, d in zip(asks, plain.propose(asks))]
    forwards = caught.stats["forwards"]
    assert caught.catch_up(grown) == 0 and caught.stats["forwards"] == forwards


def test_a_bounded_catch_up_drafts_from_the_last_rows_of_the_context(target, drafter_dir):
    drafter = start(target, Checkpoint.open(drafter_dir), NO_EOS)
    context = (PROMPT * 4)[:40]
    assert drafter.catch_up([DraftAsk(0, context, 5, catch_up=8)]) == 8
    assert drafter.propose([DraftAsk(0, context, 5, catch_up=8)]) == [serial(drafter.model, context[-9:], 5)]
    # a live slot that fell 30 tokens behind skips to the last 8 and reads the context with a cut in it; the drafts
    # it fed itself are not the context's, so they are trimmed first
    later = context + [(7 * i) % TARGET_VOCAB for i in range(30)]
    assert drafter.slots[0].tokens[9:] != later[40:44]
    (drafts,) = drafter.propose([DraftAsk(0, later, 5, catch_up=8)])
    assert drafts == serial(drafter.model, context[-9:] + later[-9:], 5)
    # then it follows the context as usual: accepted drafts cost no second pass
    before = drafter.stats["rows"]
    assert drafter.propose([DraftAsk(0, later + drafts + [3], 5)]) == [serial(
        drafter.model, context[-9:] + later[-9:] + drafts + [3], 5)]
    assert drafter.stats["rows"] - before == 2 + 4


def test_a_kept_slot_with_a_cut_shares_only_its_uncut_prefix(target, drafter_dir):
    drafter = start(target, Checkpoint.open(drafter_dir), NO_EOS.replace(max_kept=2))
    drafter.propose([DraftAsk(1, PROMPT, 3)])
    later = PROMPT + [(5 * i) % TARGET_VOCAB for i in range(40)]
    drafter.propose([DraftAsk(1, later, 3, catch_up=4)])
    drafter.release(1)
    before = drafter.stats["rows"]
    assert drafter.propose([DraftAsk(2, later, 3)]) == [serial(drafter.model, later, 3)]
    assert drafter.stats["slot_reuses"] == 1 and drafter.stats["rows"] - before == len(later) - len(PROMPT) + 2
