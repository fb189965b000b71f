"""storage/policies.py on small, known traces (sizes of 1: capacities count records)."""

from __future__ import annotations

import numpy as np
import pytest

from loaderd.storage.policies import (
    ImportancePolicy,
    LruPolicy,
    Policy,
    StaticPolicy,
    make_policy,
)


def replay(p: Policy, trace: list[int]) -> list[int | None]:
    """The tier each access was served from (None: the store)."""
    out = []
    for i in trace:
        out.append(p.lookup(i))
        p.access(i, 1)
    return out


def test_static_fills_in_tier_order_and_never_evicts() -> None:
    p = StaticPolicy([2, 1], 10, 1)
    assert replay(p, [1, 2, 3, 4, 1, 2, 3, 4]) == [None] * 4 + [0, 0, 1, None]
    assert p.evictions == [0, 0] and len(p) == 3
    assert (p.hits, p.misses) == ([2, 1], [6, 5])  # a DRAM miss is looked up in the arena


def test_lru_demotes_dram_victims_and_promotes_arena_hits() -> None:
    p = LruPolicy([2, 2], 10, 1)
    moves = [p.access(i, 1) for i in (1, 2, 3)]
    assert moves[2] == [("admit", 3, 0), ("demote", 1, 1)]  # 1 was least recent in DRAM
    assert p.lookup(1) == 1 and p.lookup(2) == 0 and p.lookup(3) == 0
    assert p.access(1, 1) == [("promote", 1, 0), ("demote", 2, 1)]
    p.access(4, 1)  # DRAM 1,4; arena 2,3 -> 3 demoted, 2 is the oldest in the arena
    p.access(5, 1)  # 4 down to the arena, which drops 2
    assert p.lookup(2) is None and p.evictions == [0, 1]
    assert p.promotions == [1, 1] and p.demotions[1] == 4


def test_lru_thrashes_on_a_cycle_larger_than_the_cache() -> None:
    p = LruPolicy([2, 1], 10, 1)
    served = replay(p, list(range(4)) * 5)
    assert served.count(None) == 20  # the classic worst case: every access misses


def test_importance_places_top_in_dram_next_in_arena() -> None:
    p = ImportancePolicy([2, 3], 10, 1)
    p.place(np.array([9, 8, 7, 6, 5, 4, 3]))
    assert [p.target(i) for i in (9, 8, 7, 6, 5, 4)] == [0, 0, 1, 1, 1, -1]
    trace = [4, 9, 7, 0, 8, 6, 5, 4, 9, 7, 8, 6, 5, 0]
    served = replay(p, trace)
    # first sight of each targeted id fills its slot; 4 and 0 are never admitted
    assert served == [None] * 7 + [None, 0, 1, 0, 1, 1, None]
    assert len(p) == 5 and p.evictions == [0, 0]


def test_importance_is_static_within_an_epoch() -> None:
    p = ImportancePolicy([1, 1], 10, 1)
    p.place(np.array([1, 2]))
    replay(p, [1, 2])
    for i in range(3, 10):  # a storm of misses of unranked ids changes nothing
        assert p.access(i, 1) == []
    assert p.lookup(1) == 0 and p.lookup(2) == 1


def test_importance_replacement_moves_between_tiers_and_evicts_lazily() -> None:
    p = ImportancePolicy([1, 2], 10, 1)
    p.place(np.array([1, 2, 3]))
    replay(p, [1, 2, 3])
    moves = p.place(np.array([2, 1, 4]))  # 2 up, 1 down; 3 stays until 4 needs its room
    assert ("demote", 1, 1) in moves and ("promote", 2, 0) in moves
    assert p.lookup(1) == 1 and p.lookup(2) == 0 and p.lookup(3) == 1
    assert moves.index(("promote", 2, 0)) < moves.index(("demote", 1, 1))
    assert p.access(4, 1) == [("drop", 3, 1), ("admit", 4, 1)]
    assert p.evictions == [0, 1]


def test_importance_evicts_what_a_ranking_drops_oldest_admitted_first() -> None:
    p = ImportancePolicy([3], 10, 1)
    replay(p, [7, 12, 5])  # before any ranking DRAM fills in this order (12: outside 0..9)
    p.place(np.array([0, 1, 2, 5]))  # wants 0, 1, 2 in DRAM: 7, 12 and 5 are now spare
    assert p.access(0, 1) == [("drop", 7, 0), ("admit", 0, 0)]
    assert p.access(1, 1) == [("drop", 12, 0), ("admit", 1, 0)]
    assert p.access(2, 1) == [("drop", 5, 0), ("admit", 2, 0)]
    assert p.access(3, 1) == []  # not wanted: nothing moves


def test_importance_swaps_tiers_past_ids_outside_the_ranking() -> None:
    p = ImportancePolicy([2, 2], 10, 1)
    replay(p, [12, 3, 4, 15])  # before any ranking: DRAM 12, 3; the arena 4, 15 (outside 0..9)
    moves = p.place(np.array([4, 3, 5]))  # 4 up into the room of 12, which no ranking wants
    assert moves == [("drop", 12, 0), ("promote", 4, 0)]
    assert p.access(5, 1) == [("admit", 5, 1)]  # the room 4 left: 15 stays, spare
    assert [p.lookup(i) for i in (3, 4, 5, 12, 15)] == [0, 0, 1, None, 1]


def test_importance_before_a_ranking_behaves_like_static() -> None:
    p = ImportancePolicy([1, 1], 10, 1)
    assert replay(p, [5, 6, 7, 5, 6, 7]) == [None, None, None, 0, 1, None]


def test_importance_counts_ranking_with_record_bytes() -> None:
    p = ImportancePolicy([100, 250], 10, 50)  # two records in DRAM, five in the arena
    p.place(np.arange(10))
    assert [p.target(i) for i in range(8)] == [0, 0, 1, 1, 1, 1, 1, -1]


def test_forget_and_adopt() -> None:
    p = ImportancePolicy([0, 2], 10, 1)
    assert p.adopt(3, 1, 1) and p.adopt(4, 1, 1) and not p.adopt(5, 1, 1)
    assert p.lookup(3) == 1
    p.forget(3)
    assert p.lookup(3) is None and p.evictions == [0, 1]
    p.forget(3)  # twice is harmless


def test_access_counts_where_the_record_was_found() -> None:
    p = StaticPolicy([1, 1], 10, 1)
    p.access(1, 1)
    p.access(1, 1, None)  # read from the store although the policy holds it now
    assert (p.hits, p.misses) == ([0, 0], [2, 2])
    p.access(1, 1, 0)
    assert (p.hits, p.misses) == ([1, 0], [2, 2])


def test_make_policy_names() -> None:
    assert isinstance(make_policy("lru", [1], 2, 1), LruPolicy)
    with pytest.raises(ValueError, match="`cache_policy` must be one of"):
        make_policy("fifo", [1], 2, 1)
    with pytest.raises(ValueError, match="capacities"):
        StaticPolicy([-1], 2, 1)


def test_ranking_puts_selected_and_rescored_first() -> None:
    from loaderd.tiering import ranking

    imp = np.array([0.5, 3.0, np.nan, 2.0, 1.0], np.float32)
    assert ranking(imp, np.arange(5)) is None  # all selected, none re-scored: keep placement
    r = ranking(imp, np.array([0, 2, 3]), np.array([0]))
    assert r is not None and r.tolist() == [0, 3, 2, 1, 4]


def test_node_ranking_holds_only_the_node_share() -> None:
    from loaderd.tiering import node_ranking

    imp = np.array([0.5, 3.0, np.nan, 2.0, 1.0, 4.0], np.float32)
    # Re-scored first, then by importance (never scored last); nothing outside the share.
    r = node_ranking(imp, np.array([0, 2, 3, 4]), np.array([4, 5]))
    assert r is not None and r.tolist() == [4, 3, 0, 2]
    assert node_ranking(imp, np.array([1, 3])).tolist() == [1, 3]  # type: ignore[union-attr]
    assert node_ranking(imp, np.arange(6)) is None  # a node reading everything keeps it
    policy = ImportancePolicy([2, 10], 6, 1)
    policy.place(node_ranking(imp, np.array([0, 3, 4])))
    t = policy.targets()
    assert t is not None and np.flatnonzero(t >= 0).tolist() == [0, 3, 4]
    assert t.tolist()[3] == t.tolist()[4] == 0 and not t.flags.writeable


@pytest.mark.parametrize("kind", [LruPolicy, ImportancePolicy, StaticPolicy])
def test_hit_all_counts_and_orders_as_one_access_each(kind: type[Policy]) -> None:
    one, many = kind([4, 4], 10, 1), kind([4, 4], 10, 1)
    for p in (one, many):
        for i in (1, 2, 3, 4, 5):
            p.access(i, 1)
    held = [i for i in (1, 2, 3, 4, 5) if one.lookup(i) == 0]
    assert one.all_in(held, 0) and not one.all_in([*held, 9], 0) and not one.all_in([], 0)
    moves = [m for i in held[::-1] for m in one.access(i, 1, 0)]
    assert many.hit_all(held[::-1], 0) == moves
    assert (many.hits, many.misses) == (one.hits, one.misses)
    assert [list(h) for h in many.held] == [list(h) for h in one.held]  # LRU order alike


def agrees(p: Policy, n: int) -> None:
    """The whole-batch answers say what the per-id bookkeeping says, for every id."""
    ids = np.arange(n)
    per_id = [p.lookup(i) for i in range(n)]
    assert p.lookup_many(ids).tolist() == [-1 if t is None else t for t in per_id]
    assert [t for t, h in enumerate(p.held) for _ in h] == sorted(
        t for t in per_id if t is not None
    )
    for tier in range(len(p.capacities)):
        mine = [i for i in range(n) if per_id[i] == tier]
        assert p.all_in(mine, tier) == p.all_in(np.array(mine, np.int64), tier) == bool(mine)
        for other in (i for i in range(n) if per_id[i] != tier):
            assert not p.all_in([*mine, other], tier)


@pytest.mark.parametrize("name", ["importance", "lru", "static"])
def test_batch_lookups_agree_with_the_policy_through_every_move(name: str) -> None:
    # Admissions, evictions, promotions and demotions (re-rankings), forgets and adoptions:
    # after each step the array answers exactly what the policy's own state does.
    n = 60
    rng = np.random.default_rng(7)
    p = make_policy(name, [6, 9], n, 1)
    kinds: set[str] = set()
    for step in range(400):
        r = rng.random()
        if r < 0.06:
            kinds.update(k for k, _, _ in p.place(rng.permutation(n)[: int(rng.integers(5, n))]))
        elif r < 0.1:
            p.forget(int(rng.integers(n)))
            kinds.add("forget")
        elif r < 0.13:
            p.adopt(int(rng.integers(n)), 1, int(rng.integers(2)))
        elif r < 0.3:
            batch = [i for i in rng.permutation(n)[:5].tolist() if p.lookup(i) == 0]
            if p.all_in(batch, 0):
                kinds.update(k for k, _, _ in p.hit_all(batch, 0))
        else:
            kinds.update(k for k, _, _ in p.access(int(rng.integers(n)), 1))
        if step % 7 == 0:
            agrees(p, n)
    agrees(p, n)
    assert {"admit", "forget"} <= kinds
    if name != "static":
        assert {"drop", "promote", "demote"} <= kinds


def test_batch_lookups_answer_ids_outside_the_dataset() -> None:
    p = StaticPolicy([4, 4], 10, 1)
    p.access(3, 1)
    assert p.adopt(12, 1, 1) and p.adopt(-2, 1, 0)  # an arena from another store: kept
    assert p.lookup_many(np.array([3, 12, -2, 5, 40])).tolist() == [0, 1, 0, -1, -1]
    assert p.all_in([3, -2], 0) and p.all_in([12], 1) and not p.all_in([3, 40], 0)
    p.forget(12)
    assert p.lookup_many(np.array([12, 3])).tolist() == [-1, 0]
    assert p.lookup_many(np.array([], np.int64)).tolist() == []


@pytest.mark.parametrize("name", ["importance", "lru", "static"])
def test_miss_all_does_what_one_access_per_id_does(name: str) -> None:
    # Two twins take the same trace; at random points one takes a batch of misses as a whole,
    # the other id by id: same moves in the same order, same counts, same state (LRU order
    # included), whether the batch fits in one step or falls back to one record at a time.
    n = 80
    rng = np.random.default_rng(11)
    whole, each = make_policy(name, [90, 60], n, 3), make_policy(name, [90, 60], n, 3)
    together = apart = 0
    for _ in range(300):
        r = rng.random()
        if r < 0.05:
            ranking = rng.permutation(n)[: int(rng.integers(5, n))]
            assert whole.place(ranking) == each.place(ranking)
        elif r < 0.2:  # a tier lost records: room for a batch to fit whole again
            for i in rng.permutation(n)[:6].tolist():
                whole.forget(i)
                each.forget(i)
        elif r < 0.55:
            unheld = [i for i in rng.permutation(n).tolist() if whole.lookup(i) is None]
            batch = unheld[: int(rng.integers(1, 9))]
            sizes = rng.integers(1, 5, len(batch)).tolist()
            if whole._fits_all(batch, sizes) is None:
                apart += 1
            else:
                together += 1
            moves = whole.miss_all(batch, sizes)
            assert moves == [
                m for i, s in zip(batch, sizes, strict=True) for m in each.access(i, s, None)
            ]
        else:
            i, size = int(rng.integers(n)), int(rng.integers(1, 8))
            assert whole.access(i, size) == each.access(i, size)
        assert (whole.hits, whole.misses, whole.used) == (each.hits, each.misses, each.used)
        assert [list(h.items()) for h in whole.held] == [list(h.items()) for h in each.held]
        assert whole.lookup_many(np.arange(n)).tolist() == each.lookup_many(np.arange(n)).tolist()
    assert together > 10 and apart > 10


@pytest.mark.parametrize("name", ["importance", "static"])
def test_access_all_does_what_one_access_per_id_does(name: str) -> None:
    # Twins again: one takes a batch of hits and misses as a whole (``access_all``), the
    # other id by id. ``found`` may disagree with the placement now (a record moved between
    # the read and the accounting); tiers fill up, so that most misses change nothing, and
    # rankings leave some records unwanted.
    n = 120
    rng = np.random.default_rng(5)
    whole, each = make_policy(name, [40, 30], n, 3), make_policy(name, [40, 30], n, 3)
    full = 0
    for _ in range(400):
        r = rng.random()
        if r < 0.05:
            ranking = rng.permutation(n)[: int(rng.integers(5, n))]
            assert whole.place(ranking) == each.place(ranking)
        elif r < 0.1:
            for i in rng.permutation(n)[:4].tolist():
                whole.forget(i)
                each.forget(i)
        else:
            batch = rng.permutation(n)[: int(rng.integers(1, 12))].tolist()
            sizes = rng.integers(1, 6, len(batch)).tolist()
            found = [-1 if (t := whole.lookup(i)) is None else t for i in batch]
            if rng.random() < 0.2:  # stale: read from a tier that no longer holds it, or none
                found[0] = int(rng.integers(-1, 2))
            full += all(not whole.room(t, min(sizes)) for t in range(2))
            moves = whole.access_all(batch, sizes, np.array(found, np.int8))
            assert moves == [
                m
                for i, s, f in zip(batch, sizes, found, strict=True)
                for m in each.access(i, s, None if f < 0 else f)
            ]
        assert (whole.hits, whole.misses, whole.used) == (each.hits, each.misses, each.used)
        assert whole.evictions == each.evictions
        assert [list(h.items()) for h in whole.held] == [list(h.items()) for h in each.held]
        assert whole.lookup_many(np.arange(n)).tolist() == each.lookup_many(np.arange(n)).tolist()
    assert full > 20


def test_access_all_leaves_policies_that_move_hits_and_repeats_to_one_access_each() -> None:
    lru, static = make_policy("lru", [10, 10], 20, 1), make_policy("static", [10, 10], 20, 1)
    assert lru.access_all([1, 2], [1, 1], np.array([-1, -1], np.int8)) is None
    assert static.access_all([1, 1], [1, 1], np.array([-1, -1], np.int8)) is None
    assert lru.misses == static.misses == [0, 0]  # nothing counted
