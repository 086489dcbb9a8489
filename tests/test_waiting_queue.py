"""The waiting queue's order when the policy's priorities move with time only
part of the time (agentserve's deadline applies only while its share does)."""

from __future__ import annotations

from agentserve.engine.request import Request
from agentserve.engine.waiting_queue import WaitingQueue


def test_a_queue_resorts_while_time_moves_priorities_and_once_after():
    moving = {"on": False}
    calls = {"n": 0}

    def priority(req, now):
        calls["n"] += 1
        late = moving["on"] and now - req.arrival_time >= 10.0
        return (not late, -req.arrival_time)  # newest first, unless late

    q = WaitingQueue(priority, lambda: moving["on"])
    old, new = Request("a", "A", [1], 1, arrival_time=0.0), Request("b", "B", [1], 1, arrival_time=5.0)
    q.push(old, 5.0)
    q.push(new, 5.0)
    assert list(q) == [new, old]
    before = calls["n"]
    q.order(20.0)  # not time-dependent: the kept places stand, nothing is recomputed
    assert list(q) == [new, old] and calls["n"] == before
    q.check()

    moving["on"] = True
    q.order(12.0)  # old has waited 12 s: late, first
    assert list(q) == [old, new]
    q.check()
    moving["on"] = False  # the places kept are stale now (old's says late)
    q.check()
    q.order(13.0)  # one more re-sort, by the priorities as they are now
    assert list(q) == [new, old] and old.queue_key[0] == (True, -0.0)
    q.check()
    before = calls["n"]
    q.order(14.0)
    assert calls["n"] == before


def test_a_place_taken_while_time_moves_is_resorted_after_it_stops():
    moving = {"on": True}
    q = WaitingQueue(lambda req, now: (not (moving["on"] and now - req.arrival_time >= 10.0), req.arrival_time),
                     lambda: moving["on"])
    late = Request("a", "A", [1], 1, arrival_time=0.0)
    q.push(Request("b", "B", [1], 1, arrival_time=-5.0), 0.0)
    q.push(late, 30.0)  # placed late, ahead
    assert next(iter(q)) is late
    moving["on"] = False  # stopped before any order(): the place is still the late one
    q.check()
    q.order(31.0)
    assert next(iter(q)) is not late
    q.check()
