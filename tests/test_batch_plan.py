"""Which finished groups make the next train batch (`plan_batch`), against the admission rule: no group misses
its deadline, and the trainer never waits for a batch that cannot come."""

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.rollout.manager import plan_batch


def simulate(order: str, max_staleness: int, size: int, slots: int, batches: int, seed: int) -> list[list[int]]:
    """Admit by the manager's rule, finish running groups in a random order, take batches as soon as planned.
    Returns the batches; asserts every group is trained by its deadline and that a batch is planned as soon as
    nothing runs."""
    rng = random.Random(seed)
    start: dict[int, int] = {}  # every admitted group not yet in a batch -> its start version
    running: list[int] = []
    done: set[int] = set()
    admitted, taken = 0, []
    while len(taken) < batches:
        version = len(taken)
        while admitted < (max_staleness + version + 1) * size and len(running) < slots:
            start[admitted] = version
            running.append(admitted)
            admitted += 1
        pick = plan_batch(version, size, max_staleness, order, start, done)
        if pick is None:
            assert running, f"batch {version} can never be planned: {start}, done {done}"
            done.add(running.pop(rng.randrange(len(running))))
            continue
        assert len(pick) == size and set(pick) <= done
        for i in pick:
            assert version - start[i] <= max_staleness, f"group {i} (started at {start[i]}) trained at {version}"
            del start[i]
            done.discard(i)
        taken.append(pick)
    return taken


@settings(max_examples=300, deadline=None)
@given(order=st.sampled_from(["deadline", "admission"]), max_staleness=st.integers(0, 4), size=st.integers(1, 4),
       slots=st.integers(1, 24), seed=st.integers(0, 2**32))
def test_no_group_misses_its_deadline_and_no_batch_waits_forever(order, max_staleness, size, slots, seed):
    simulate(order, max_staleness, size, slots, batches=12, seed=seed)


def test_a_group_due_later_waits_while_earlier_ones_would_not_fit():
    # batch 1 of one group at staleness 2: groups 0 and 1 (due by batch 2) are running, group 3 (due by 3) has
    # finished. Taking 3 now would leave two groups for batch 2's one place, so batch 1 must wait.
    assert plan_batch(1, 1, 2, "deadline", {0: 0, 1: 0, 3: 1}, {3}) is None
    assert plan_batch(1, 1, 2, "deadline", {0: 0, 1: 0, 3: 1}, {3, 1}) == [1]
    assert plan_batch(0, 1, 2, "deadline", {0: 0, 1: 0, 2: 0}, {2}) == [2]  # short groups overtake within the bound


def test_admission_order_waits_for_the_oldest_groups():
    assert plan_batch(0, 2, 2, "admission", {0: 0, 1: 0, 2: 0}, {1, 2}) is None
    assert plan_batch(0, 2, 2, "admission", {0: 0, 1: 0, 2: 0}, {0, 1, 2}) == [0, 1]


def test_deadline_order_overtakes_and_admission_order_does_not():
    # a slow group (finishing last whenever it can) holds admission order back, not deadline order
    assert any(simulate("deadline", 2, 2, 8, 6, seed) != simulate("admission", 2, 2, 8, 6, seed)
               for seed in range(20))


@given(size=st.integers(1, 4), slots=st.integers(1, 16), seed=st.integers(0, 2**32))
def test_both_orders_give_the_same_batches_in_synchronous_rl(size, slots, seed):
    assert simulate("deadline", 0, size, slots, 5, seed) == simulate("admission", 0, size, slots, 5, seed)
