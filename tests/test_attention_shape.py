"""The step-time model's attention features on a model with sliding-window
layers (engine/attention_shape.py): the pairs a layer reads on average, the
longest chunk a step-time budget allows, and the shape a model's layers give."""

from __future__ import annotations

import pytest

from agentserve.engine.attention_shape import FULL, AttentionShape
from agentserve.engine.step_time import StepTimeModel, step_features
from agentserve.engine.scheduler_output import ScheduledChunk


def brute_pairs(shape: AttentionShape, start: int, n: int) -> float:
    full = sum(p + 1 for p in range(start, start + n))
    if shape.window is None:
        return full
    windowed = sum(min(p + 1, shape.window) for p in range(start, start + n))
    return shape.global_share * full + (1 - shape.global_share) * windowed


@pytest.mark.parametrize("start,n", [(0, 1), (0, 7), (3, 9), (5, 20), (40, 3), (0, 100), (17, 64)])
def test_pairs_are_the_sum_over_queries(start, n):
    for shape in (FULL, AttentionShape(1 / 6, 8), AttentionShape(0.5, 1)):
        assert shape.pairs(start, n) == pytest.approx(brute_pairs(shape, start, n))
        assert shape.context(start + 1) == pytest.approx(brute_pairs(shape, start, 1))


def test_the_shape_of_a_models_layers():
    assert AttentionShape.of([None, None]) is FULL
    gemma = AttentionShape.of([512] * 5 + [None])
    assert (gemma.global_share, gemma.window) == (pytest.approx(1 / 6), 512)
    assert AttentionShape.of([8, 16, None, None]).window == 8
    with pytest.raises(ValueError):
        AttentionShape(0.5, None)
    with pytest.raises(ValueError):
        AttentionShape(1.5, 8)


def fitted(shape: AttentionShape) -> StepTimeModel:
    """A model that has seen steps costing 1 ms + 10 us a token + 1 ns a pair (as counted)."""
    m = StepTimeModel(shape=shape)
    for i in range(40):
        start, n = 1000 * (i % 8), 64 + 32 * (i % 5)
        a = shape.pairs(start, n)
        m.observe(n, a, 0, 0, 0.001 + 1e-5 * n + 1e-9 * a)
        m.observe(0, 0, 4, 4 * shape.context(start + 1), 0.001 + 1e-6 * (i % 3))
    return m


def test_a_windowed_model_takes_longer_chunks_late_in_a_long_prompt():
    gemma = AttentionShape(1 / 6, 512)
    full, win = fitted(FULL), fitted(gemma)
    assert win.ready and full.ready
    n_full, n_win = full.max_chunk(30000, 0.05), win.max_chunk(30000, 0.05)
    assert n_win > 2 * n_full
    for m, n in ((full, n_full), (win, n_win)):  # the longest that fits: one more token does not
        assert m.chunk_time(30000, n) <= 0.05 < m.chunk_time(30000, n + 1)
    # at the start of a prompt (inside the window) the two count alike
    assert gemma.pairs(0, 256) == FULL.pairs(0, 256)


def test_step_features_count_decode_context_per_layer_kind():
    class Req:
        num_prompt_tokens = 50

    chunks = [ScheduledChunk(Req(), 4000, 1, True), ScheduledChunk(Req(), 100, 1, True)]
    _, _, rows, ctx, _, _ = step_features(chunks, AttentionShape(0.25, 512))
    assert rows == 2
    assert ctx == pytest.approx(0.25 * 4001 + 0.75 * 512 + 101)
