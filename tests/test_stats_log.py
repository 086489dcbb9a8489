"""The engine's periodic stats line (server/stats_log.py)."""

from agentserve.server.engine_snapshot import EngineSnapshot
from agentserve.server.stats_log import stats_line


def snap(**kw) -> EngineSnapshot:
    base = dict(num_running=0, num_waiting=0, num_blocks=100, num_free_blocks=100, num_pinned_blocks=0,
                num_pinned_programs=0, block_size=16, steps=0, preemptions=0, admitted_prompt_tokens=0,
                hit_tokens=0, loaded_tokens=0, pins_created=0, pins_hit=0, pins_expired=0, pins_reclaimed=0,
                pins_released_early=0, pins_released_at_end=0)
    base.update(kw)
    return EngineSnapshot.of(**base)


def test_nothing_ran_nothing_logged():
    s = snap(steps=5, executed_steps=3)
    assert stats_line(s, s, 10.0) is None
    assert stats_line(s, s.but(steps=50), 10.0) is None  # empty scheduling passes (pin review) only


def test_interval_figures():
    a = snap(steps=10, executed_steps=10, prefill_tokens=100, decode_tokens=50, admitted_prompt_tokens=1000, hit_tokens=200,
             execute_s=1.0, pins_created=1)
    b = a.but(steps=130, executed_steps=110, prefill_tokens=5100, decode_tokens=450, admitted_prompt_tokens=5000, hit_tokens=3200,
                execute_s=9.0, num_running=3, num_waiting=2, num_free_blocks=25, num_pinned_blocks=40,
                num_pinned_programs=2, pins_created=5, pins_hit=3, preemptions=2)
    line = stats_line(a, b, 10.0)
    assert "prompt 500 tok/s, generation 40.0 tok/s" in line
    assert "prefix hits 75% of 4000 admitted prompt tokens" in line
    assert "running 3, waiting 2" in line
    assert "KV 75% used, 40% pinned by 2 programs" in line
    assert "100 steps, model busy 80% (80.0 ms a step)" in line
    assert "pins +4 hit 3 expired 0 reclaimed 0" in line
    assert "preemptions 2" in line


def test_the_logged_line_is_short_and_the_details_go_to_debug(caplog):
    import logging

    from agentserve.server.stats_log import StatsLog

    a = snap(steps=10, executed_steps=10, prefill_tokens=100, decode_tokens=50, admitted_prompt_tokens=1000,
             hit_tokens=200, execute_s=1.0, recent_decode_step_s=(0.1,) * 8, decode_steps=2)
    b = a.but(steps=130, executed_steps=110, prefill_tokens=5100, decode_tokens=450, admitted_prompt_tokens=5000,
              hit_tokens=3200, execute_s=9.0, num_running=3, num_waiting=2, num_free_blocks=25,
              num_pinned_blocks=40, num_pinned_programs=2, pins_created=5, preemptions=2, decode_steps=8)
    short = stats_line(a, b, 10.0, detail=False)
    assert short == ("10 s: prompt 500 tok/s, generation 40.0 tok/s; prefix hits 75%; running 3, waiting 2; "
                     "KV 75% used, 40% pinned; model busy 80%")
    assert len(short) < 160 < len(stats_line(a, b, 10.0))
    stats = StatsLog(10.0)
    with caplog.at_level(logging.DEBUG, logger="agentserve.server"):
        stats.tick(0.0, lambda: a)
        stats.tick(10.0, lambda: b)
    info = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    debug = [r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG]
    assert info == ["engine: " + short]
    assert len(debug) == 1 and "preemptions 2" in debug[0] and "longest step" in debug[0]


def test_longest_step_with_decodes_and_capped_prefills():
    a = snap(executed_steps=10, decode_steps=4, capped_steps=1, recent_decode_step_s=(0.9, 0.05, 0.05, 0.05))
    b = a.but(executed_steps=20, decode_steps=7, capped_steps=3,
                recent_decode_step_s=a.recent_decode_step_s + (0.12, 0.18, 0.04))
    line = stats_line(a, b, 10.0)
    assert "longest step with decodes 180 ms, p99 180 ms (prefill capped in 2 steps)" in line  # the 0.9 s was before
    assert "longest step" not in stats_line(a, a.but(executed_steps=12), 10.0)  # no decodes this interval


def test_p99_of_steps_with_decodes_ignores_a_lone_outlier():
    a = snap(executed_steps=0, decode_steps=0, capped_steps=0, recent_decode_step_s=())
    times = (0.05,) * 198 + (0.12, 0.9)
    b = a.but(executed_steps=200, decode_steps=200, recent_decode_step_s=times)
    assert "longest step with decodes 900 ms, p99 120 ms" in stats_line(a, b, 10.0)


def test_p99_over_the_recent_steps_beside_the_intervals():
    """An interval of 50 steps has its longest as its p99; the recent steps of
    earlier intervals give a p99 that one slow step does not set."""
    a = snap(executed_steps=0, decode_steps=150, recent_decode_step_s=(0.05,) * 150)
    b = a.but(executed_steps=50, decode_steps=200, recent_decode_step_s=(0.05,) * 199 + (0.3,))
    line = stats_line(a, b, 10.0)
    assert "longest step with decodes 300 ms, p99 300 ms" in line
    assert "p99 of the last 200 50 ms" in line


def test_step_model_in_the_line_once_it_has_samples():
    a = snap(executed_steps=1)
    b = a.but(executed_steps=5)
    assert "step model" not in stats_line(a, b, 10.0)
    b = b.but(step_model=(0.004, 2e-4, 1e-8, 1e-3, 2e-6), step_margin=1.13)
    assert ("step model 4.0 ms + 0.200 ms a prompt token + 10.00 ms per M attention pairs + 1.00 ms a decode "
            "+ 2.000 ms per 1k context, x1.13") in stats_line(a, b, 10.0)
