"""Speculation cache keys, hit/miss, miss fallback, KV rollback and branch commit."""
import pytest
import torch
from checkpoints import make_checkpoint

from saguaro.runtime.core.sampling import SamplingParams
from saguaro.runtime.decoding.speculator import Speculator, lockstep
from saguaro.runtime.decoding.verifier import Verifier
from saguaro.runtime.engines.torch_engine import TorchEngine

K = 3
PROMPT = [1, 7, 12, 30, 9]
FANOUT = torch.tensor([2, 2, 1, 2])


@pytest.fixture(scope="module")
def draft_engine(tmp_path_factory):
    return TorchEngine(make_checkpoint(tmp_path_factory.mktemp("draft") / "m", vocab_size=48, hidden=32,
                                       layers=2, seed=3, max_positions=128))


class Drafting:
    """One speculator driven alone (its coroutines run through `lockstep` one at a time)."""

    def __init__(self, engine, sampling=SamplingParams()):
        self.engine, self.speculator = engine, Speculator(engine, sampling, None, capacity=128)

    def draft(self, ids, k=K):
        return lockstep(self.engine, [self.speculator.draft(ids, k)])[0]

    def prespeculate(self, ids, draft, fanout):
        return lockstep(self.engine, [self.speculator.prespeculate(ids, draft, fanout)])[0]

    def adopt(self, new_ids, speculation, branch):
        return self.speculator.adopt(new_ids, speculation, branch)

    @property
    def cached(self):
        return self.speculator.cached

    @property
    def cache(self):
        return self.speculator.cache


def new_speculator(engine, sampling=SamplingParams()):
    return Drafting(engine, sampling)


def live_kv(speculator):
    cache = speculator.cache
    return cache.pool.entries(cache.slot)[..., :cache.length, :]


def test_keys_cover_the_fanout_and_exclude_the_next_draft(draft_engine):
    speculator = new_speculator(draft_engine)
    draft = speculator.draft(PROMPT)
    speculation = speculator.prespeculate(PROMPT, draft, FANOUT)
    assert len(speculation.keys) == int(FANOUT.sum())
    for depth in range(K + 1):
        tokens = [t for (j, t) in speculation.keys if j == depth]
        assert len(tokens) == FANOUT[depth]
        if depth < K:
            assert int(draft.tokens[depth]) not in tokens
    some_key = next(iter(speculation.keys))
    assert speculation.lookup(*some_key) == speculation.keys[some_key]
    assert speculation.lookup(K, -1) is None  # a miss


def test_each_branch_drafts_what_ordinary_drafting_would(draft_engine):
    speculator = new_speculator(draft_engine)
    draft = speculator.draft(PROMPT)
    speculation = speculator.prespeculate(PROMPT, draft, FANOUT)
    for (depth, token), branch in speculation.keys.items():
        context = PROMPT + draft.tokens[:depth].tolist() + [token]
        ordinary = new_speculator(draft_engine).draft(context)
        assert speculation.drafts[branch].tokens.tolist() == ordinary.tokens.tolist()
        assert torch.allclose(speculation.drafts[branch].logits, ordinary.logits, atol=1e-4)


@pytest.mark.parametrize("branch", range(int(FANOUT.sum())))
def test_committing_a_hit_branch_leaves_the_cache_of_ordinary_drafting(draft_engine, branch):
    speculator = new_speculator(draft_engine)
    draft = speculator.draft(PROMPT)
    speculation = speculator.prespeculate(PROMPT, draft, FANOUT)
    (depth, token), = [key for key, b in speculation.keys.items() if b == branch]
    new_ids = PROMPT + draft.tokens[:depth].tolist() + [token]
    adopted = speculator.adopt(new_ids, speculation, branch)

    ordinary = new_speculator(draft_engine)
    expected = ordinary.draft(new_ids)
    assert adopted.tokens.tolist() == expected.tokens.tolist()
    assert speculator.cached == ordinary.cached
    got, want = live_kv(speculator), live_kv(ordinary)
    assert got.shape == want.shape and torch.allclose(torch.from_numpy(got), torch.from_numpy(want), atol=1e-5)
    # and the round after the hit goes on exactly like ordinary drafting
    follow_up = new_ids + expected.tokens[:1].tolist() + [5]
    assert speculator.draft(follow_up).tokens.tolist() == ordinary.draft(follow_up).tokens.tolist()


def test_miss_fallback_rolls_the_tree_back(draft_engine):
    speculator = new_speculator(draft_engine)
    draft = speculator.draft(PROMPT)
    speculator.prespeculate(PROMPT, draft, FANOUT)
    outcome_ids = PROMPT + draft.tokens[:1].tolist() + [int(draft.tokens[1])]  # a key never cached
    fallback = speculator.draft(outcome_ids)
    assert speculator.cache.length == len(outcome_ids) + K - 1
    assert fallback.tokens.tolist() == new_speculator(draft_engine).draft(outcome_ids).tokens.tolist()


def test_verifier_rolls_back_rejected_drafts(draft_engine):
    """The target keeps `last, d_1..d_a`; what follows matches a fresh prefill."""
    verifier = Verifier(draft_engine, SamplingParams(), K)
    draft_engine.forward_batch([verifier.prefill(PROMPT[:-1])])  # every token but `last`
    drafter = new_speculator(draft_engine)
    draft = drafter.draft(PROMPT)
    wrong = draft.tokens.clone()
    wrong[1] = (wrong[1] + 1) % 48  # the target's own greedy choice, spoiled at depth 1
    draft.tokens = wrong
    outcome = draft_engine.verify_batch([verifier.round(PROMPT, draft, K)])[0]
    verifier.keep(PROMPT, outcome)
    assert outcome.accepted == 1
    ids = PROMPT + wrong[:1].tolist() + [outcome.bonus]
    assert verifier.cache.length == len(ids) - 1
    fresh = draft_engine.new_cache(64)
    want = draft_engine.forward(fresh, torch.tensor(ids), torch.arange(len(ids)))[-1]
    got = draft_engine.forward(verifier.cache, torch.tensor(ids[-1:]), torch.tensor([len(ids) - 1]))[-1]
    assert torch.allclose(got, want, atol=1e-4)


def test_cache_fork_is_independent(draft_engine):
    cache = draft_engine.new_cache(32)
    draft_engine.forward(cache, torch.tensor(PROMPT), torch.arange(len(PROMPT)))
    twin = cache.fork()
    before = twin.pool.entries(twin.slot).copy()
    draft_engine.forward(cache, torch.tensor([3, 4]), torch.tensor([5, 6]))
    cache.truncate(2)
    assert twin.length == len(PROMPT) and (twin.pool.entries(twin.slot) == before).all()
    with pytest.raises(ValueError, match="truncate"):
        cache.truncate(10)


def test_sequences_drafted_in_lockstep_draft_what_each_drafts_alone(draft_engine):
    """One batched forward per step for several sequences (own lengths, own K, one
    pre-speculating) gives every sequence exactly its own result."""
    contexts = [PROMPT, PROMPT[:2], [1, 2, 3, 4, 5, 6, 7, 8], [9]]
    lengths = [K, 1, 2, K]
    alone = [new_speculator(draft_engine).draft(ids, k) for ids, k in zip(contexts, lengths)]
    together = [Speculator(draft_engine, SamplingParams(), None, capacity=128) for _ in contexts]
    drafts = lockstep(draft_engine, [s.draft(ids, k) for s, ids, k in zip(together, contexts, lengths)])
    for mine, theirs in zip(drafts, alone):
        assert mine.tokens.tolist() == theirs.tokens.tolist()
        assert torch.allclose(mine.logits, theirs.logits, atol=1e-5)
    speculations = lockstep(draft_engine, [together[0].prespeculate(contexts[0], drafts[0], FANOUT),
                                           together[3].draft(contexts[3] + drafts[3].tokens.tolist(), K)])
    solo = new_speculator(draft_engine)
    expected = solo.prespeculate(PROMPT, solo.draft(PROMPT), FANOUT)
    assert speculations[0].keys == expected.keys
    assert [d.tokens.tolist() for d in speculations[0].drafts] == [d.tokens.tolist() for d in expected.drafts]


def test_a_released_slot_is_reused_and_the_pool_says_when_it_is_full(draft_engine):
    caches = [draft_engine.new_cache(32) for _ in range(draft_engine.pool.slots)]
    with pytest.raises(RuntimeError, match="KV slots are in use"):
        draft_engine.new_cache(32)
    freed = caches.pop(1).slot
    del caches  # released when garbage-collected, too
    again = draft_engine.new_cache(32)
    assert again.slot == 0 or again.slot == freed


def test_a_bounded_catch_up_feeds_the_oldest_missing_tokens_and_a_later_one_the_rest(draft_engine):
    ids = [3, 14, 15, 9, 26, 5, 35, 8, 9, 7]
    speculator = Speculator(draft_engine, SamplingParams(), None, capacity=128)
    lockstep(draft_engine, [speculator.catch_up(ids[:3])])
    assert speculator.lag(ids) == 7
    lockstep(draft_engine, [speculator.catch_up(ids, 4)])
    assert speculator.cached == ids[:7] and speculator.lag(ids) == 3
    lockstep(draft_engine, [speculator.catch_up(ids)])
    assert speculator.cached == ids and speculator.lag(ids) == 0
    whole = Speculator(draft_engine, SamplingParams(), None, capacity=128)
    lockstep(draft_engine, [whole.catch_up(ids)])
    # fed in three pieces or at once, the next draft is the same
    assert torch.equal(lockstep(draft_engine, [speculator.draft(ids, 3)])[0].tokens,
                       lockstep(draft_engine, [whole.draft(ids, 3)])[0].tokens)
    speculator.release()
    whole.release()
