"""policy/fcfs_wait.py: FCFS's waits, measured while another order runs."""

import pytest

from agentserve.policy.fcfs_wait import FcfsWait


def test_the_kth_admission_is_paired_with_the_kth_arrival_whatever_was_admitted():
    f = FcfsWait(warmup=1)
    for t in (0.0, 1.0, 2.0):
        f.arrive(t)
    assert f.quantile(0.5) is None  # no sample yet
    f.admit(5.0)  # whichever request it was, FCFS would have admitted the one of t=0 by now
    f.admit(5.5)
    assert sorted(f._samples) == [4.5, 5.0]
    f.withdraw()  # the third left unadmitted: FCFS's queue is empty too
    f.admit(9.0)  # an admission with no arrival to pair (a policy swapped in mid-run): no sample
    assert len(f) == 2 and f.quantile(0.0) == 4.5 and f.quantile(1.0) == 5.0


def test_the_window_keeps_the_latest_samples_and_the_warmup_holds_the_quantile_back():
    f = FcfsWait(window=10, warmup=5)
    for i in range(4):
        f.arrive(float(i))
        f.admit(float(i) + 100.0)
    assert f.quantile(0.9) is None
    for i in range(4, 30):
        f.arrive(float(i))
        f.admit(float(i) + (100.0 if i < 20 else i % 10))
    assert len(f) == 10 and sorted(f._sorted) == f._sorted == sorted(f._samples)
    assert f.quantile(0.9) == 9.0 and f.quantile(0.0) == 0.0  # the 100 s waits have left the window


def test_the_sizes_are_checked():
    for bad in (dict(window=0), dict(warmup=0)):
        with pytest.raises(ValueError, match="at least 1"):
            FcfsWait(**bad)
