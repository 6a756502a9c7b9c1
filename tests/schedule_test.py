"""The rollout schedule model (``magic_jax.rollout.schedule``) on cases worked by hand;
``benchmarks/rollout_schedule.py`` checks it against the engine."""

import dataclasses

import pytest

from magic_jax.rollout.schedule import Costs, Publish, carried, simulate

COSTS = Costs(step_s={1: 1.0, 2: 1.5, 4: 2.0}, prefill_s=10.0, insert_s=0.5, chunk_s=0.25)


def test_equal_lengths_are_one_chunk_with_the_whole_rollout_its_drain():
    s = simulate([[5, 5], [5, 5]], slots=4, decode_steps=64, costs=COSTS)
    # 5 tokens: the prefill gives the first, 4 decode steps the rest
    assert (s.steps, s.chunks, s.slot_steps, s.tokens) == (4, 1, 16, 16)
    # two prompts prefilled once each, one whole-group insert each, 4 steps at 4 rows
    assert s.total_s == pytest.approx(2 * 10 + 2 * 0.5 + 4 * 2.0 + 0.25)
    assert s.drain_s == pytest.approx(4 * 2.0 + 0.25) and s.idle_share == 0


def test_a_long_tail_keeps_every_slot_running_unless_the_batch_is_compacted():
    lengths = [[2, 2, 2, 8]]
    plain = simulate(lengths, slots=4, decode_steps=100, costs=COSTS)
    assert (plain.steps, plain.slot_steps, plain.tokens) == (7, 28, 10)
    assert plain.idle_share == pytest.approx(1 - 10 / 28)
    assert plain.decode_s == pytest.approx(7 * 2.0)
    # compacted: the chunk stops once 1 row is live (it fits size 2), then runs at size 1
    packed = simulate(lengths, slots=4, decode_steps=100, costs=COSTS, sizes=(1, 2), compact=True)
    assert (packed.steps, packed.chunks, packed.slot_steps, packed.tokens) == (7, 2, 10, 10)
    assert packed.decode_s == pytest.approx(1 * 2.0 + 6 * 1.0)


def test_freed_slots_are_refilled_between_chunks_and_the_drain_starts_at_the_last_insert():
    # 2, 0 and 1 decode steps; the one-token response frees its slot at once
    s = simulate([[3], [1], [2]], slots=2, decode_steps=1, costs=COSTS)
    assert (s.steps, s.chunks, s.slot_steps, s.tokens) == (2, 2, 4, 3)
    assert s.prefill_s == pytest.approx(30.0) and s.insert_s == pytest.approx(1.5)
    assert s.drain_s == pytest.approx(1.5 + 0.25)  # the chunk after prompt 2 went in


def test_whole_groups_wait_for_enough_free_slots():
    # 3 slots, groups of 2: the second group waits for the first to end
    s = simulate([[2, 2], [2, 2]], slots=3, decode_steps=1, costs=COSTS, whole_groups=True)
    assert (s.steps, s.slot_steps, s.tokens) == (2, 6, 4)


def test_step_costs_between_and_beyond_the_measured_sizes():
    c = Costs(step_s={2: 1.0, 4: 2.0, 8: 3.0})
    assert c.step(3) == pytest.approx(1.5) and c.step(6) == pytest.approx(2.5)
    assert c.step(1) == pytest.approx(0.5) and c.step(16) == pytest.approx(5.0)
    with pytest.raises(ValueError, match="slots"):
        simulate([[1]], slots=0, decode_steps=1, costs=c)


def test_by_live_rows_charges_a_chunk_its_mean_live_rows_exact_for_an_affine_step():
    # a roofline step is affine in the rows read: 0.5 + 0.5 x live rows
    affine = Costs(step_s={1: 1.0, 5: 3.0}, by_live=True)
    s = simulate([[2, 2, 2, 8]], slots=4, decode_steps=100, costs=affine)
    # step by step: one step at 4 live rows, then 6 at 1
    assert s.decode_s == pytest.approx((0.5 + 0.5 * 4) + 6 * (0.5 + 0.5 * 1))
    assert s.slot_steps == 28  # rows computed are unchanged


def test_partial_rollouts_prefill_the_context_in_flight_again_at_each_publish():
    costs = Costs(step_s={2: 1.0}, reprefill_token_s=1.0)
    pub = Publish(every=1, times=2, reprefill=True, prompt_length=3)
    s = simulate([[5, 9]], slots=2, decode_steps=2, costs=costs, publish=pub)
    # after chunk 1: both in flight with 3 tokens each -> (3 + 3) x 2; after chunk 2: the
    # second with 5 -> 3 + 5; then no version is left to move to
    assert (s.publishes, s.reprefill_s) == (2, 12 + 8)
    assert s.total_s == pytest.approx(s.decode_s + 20)
    kept = simulate([[5, 9]], slots=2, decode_steps=2, costs=costs, publish=Publish(1, 2))
    assert (kept.publishes, kept.reprefill_s) == (2, 0.0)


def test_a_carried_rollout_has_no_drain_and_needs_lengths_that_outlast_its_steps():
    costs = Costs(step_s={2: 1.0})
    equal = [[3]] * 8  # two decode steps each: a batch of 2 every 2 s
    assert carried(equal, batch=2, steps=2, slots=2, decode_steps=1, costs=costs) == 2.0
    with pytest.raises(ValueError, match="too few"):
        carried(equal, batch=2, steps=4, slots=2, decode_steps=1, costs=costs)
    # one long response in each batch of 4: plain rollouts wait for it, a carried one
    # refills the three slots the short ones free
    tail = [[2], [2], [2], [12]] * 12
    kw = dict(slots=4, decode_steps=1, costs=Costs(step_s={4: 1.0}))
    plain = simulate(tail[:4], **kw).total_s
    assert plain == 11.0
    assert carried(tail, batch=4, steps=6, warmup=2, **kw) < 0.5 * plain


def test_chunks_in_which_nothing_ends_are_counted_one_by_one():
    # 199 decode steps in chunks of 8: 24 whole chunks run at once, then one of 7
    s = simulate([[200] * 4], slots=4, decode_steps=8, costs=COSTS)
    assert (s.steps, s.chunks, s.slot_steps, s.tokens) == (199, 25, 796, 796)
    assert s.host_s == pytest.approx(25 * 0.25) and s.decode_s == pytest.approx(199 * 2.0)
    # a publish every 5 chunks stops the run of chunks at each one
    pub = Publish(every=5, times=3, reprefill=True, prompt_length=0)
    p = simulate([[200] * 4], slots=4, decode_steps=8,
                 costs=dataclasses.replace(COSTS, reprefill_token_s=1.0), publish=pub)  # fmt: skip
    assert p.publishes == 3 and p.reprefill_s == 4 * (41 + 81 + 121)
