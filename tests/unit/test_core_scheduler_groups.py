"""The n sequences of one API request (a group) enter the batch in waves of a fair share of max_num_seqs:
one request cannot take the whole batch, a request beside it is admitted at once, and every sequence of
the group still runs to its end."""

from __future__ import annotations

import pytest

from tests.unit.core_fakes import FakeRunner, make_request, make_scheduler, step


def group(name: str, n: int, max_tokens: int = 6, prompt: int = 3) -> list:
    reqs = [make_request(f"{name}-{i}", prompt, max_tokens=max_tokens, ignore_eos=True) for i in range(n)]
    for req in reqs:
        req.group_id = name
    return reqs


def running_of(s, name: str) -> int:
    return sum(r.group_id == name for r in s.running)


def make(max_num_seqs: int = 8):
    return make_scheduler(num_blocks=256, max_num_seqs=max_num_seqs, max_num_batched_tokens=64)


def test_a_group_alone_leaves_a_slot_for_the_next_arrival_and_completes():
    s = make()
    r = FakeRunner(s)
    for req in group("n", 16):
        s.add_request(req)
    done = set()
    for _ in range(200):
        if not s.has_unfinished():
            break
        _, outputs = step(s, r)
        assert running_of(s, "n") <= 7  # max_num_seqs - 1
        done |= {o.req_id for o in outputs if o.finished}
    assert done == {f"n-{i}" for i in range(16)}


def test_a_request_beside_a_group_is_admitted_at_once():
    s = make()
    r = FakeRunner(s)
    for req in group("n", 16, max_tokens=20):
        s.add_request(req)
    step(s, r)
    s.add_request(make_request("bystander", 3, max_tokens=4, ignore_eos=True))
    out, _ = step(s, r)
    assert "bystander" in [x.req_id for x in out.scheduled]


def test_groups_share_the_batch_and_every_sequence_completes():
    s = make()
    r = FakeRunner(s)
    for req in group("a", 16, max_tokens=5) + group("b", 16, max_tokens=5):
        s.add_request(req)
    s.add_request(make_request("bystander", 3, max_tokens=30, ignore_eos=True))
    done, most = set(), {"a": 0, "b": 0}
    for _ in range(500):
        if not s.has_unfinished():
            break
        _, outputs = step(s, r)
        for name in most:
            most[name] = max(most[name], running_of(s, name))
        done |= {o.req_id for o in outputs if o.finished}
        assert "bystander" in {x.req_id for x in s.running} | done  # admitted in the first step
    # 8 slots: the bystander's, one kept free, the rest split between the two groups
    assert most == {"a": 3, "b": 3}
    assert done == {f"{g}-{i}" for g in "ab" for i in range(16)} | {"bystander"}


def test_a_second_group_does_not_take_the_seat_kept_for_the_next_arrival():
    s = make()
    r = FakeRunner(s)
    for req in group("a", 8, max_tokens=20):
        s.add_request(req)
    step(s, r)
    assert running_of(s, "a") == 7
    for req in group("b", 8, max_tokens=20):
        s.add_request(req)
    step(s, r)
    assert running_of(s, "b") == 0  # it waits for a's wave: the free seat is not a group's
    s.add_request(make_request("bystander", 3, max_tokens=4, ignore_eos=True))
    out, _ = step(s, r)
    assert "bystander" in [x.req_id for x in out.scheduled]


def test_singles_filling_the_batch_leave_a_group_one_sequence_at_a_time():
    s = make(max_num_seqs=4)
    r = FakeRunner(s)
    for i in range(3):
        s.add_request(make_request(f"r{i}", 3, max_tokens=30, ignore_eos=True))
    for req in group("n", 3, max_tokens=2):
        s.add_request(req)
    done, most = set(), 0
    for _ in range(12):
        _, outputs = step(s, r)
        most = max(most, running_of(s, "n"))
        done |= {o.req_id for o in outputs if o.finished}
    assert most == 1  # no room beside the three singles but the free seat: one at a time
    assert done == {"n-0", "n-1", "n-2"}  # the singles still run


@pytest.mark.parametrize("max_num_seqs", [1, 2])
def test_a_small_batch_still_runs_a_group_one_sequence_at_least(max_num_seqs):
    s = make(max_num_seqs)
    r = FakeRunner(s)
    for req in group("n", 3, max_tokens=2):
        s.add_request(req)
    s.add_request(make_request("bystander", 3, max_tokens=2, ignore_eos=True))
    for _ in range(100):
        if not s.has_unfinished():
            break
        step(s, r)
    assert not s.has_unfinished()


def test_requests_without_a_group_are_admitted_as_before():
    s = make()
    r = FakeRunner(s)
    for i in range(10):
        s.add_request(make_request(f"r{i}", 3, max_tokens=4, ignore_eos=True))
    out, _ = step(s, r)
    assert len(out.scheduled) == 8


def test_a_group_of_one_request_is_a_single():
    s = make()
    r = FakeRunner(s)
    for req in group("a", 16, max_tokens=20):
        s.add_request(req)
    step(s, r)
    alone = make_request("b-0", 3, max_tokens=20, ignore_eos=True)
    alone.group_id = "b"  # a client's only request, where the server groups a client's requests
    s.add_request(alone)
    step(s, r)
    assert running_of(s, "b") == 1
    assert running_of(s, "a") == 7  # the groups' room is not split with a group of one
