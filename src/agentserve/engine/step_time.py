"""How long an engine step takes, learned from the steps that ran.

A step's time is fitted as

    t = a + b*P + c*A + d*D + e*K + f*R + g*RK

where P is the step's prefill tokens, A = sum over prefill chunks of
n*start + n*(n+1)/2 (the query-key pairs a chunk of n tokens after `start`
cached ones attends to, so a chunk late in a long prompt costs more than the
same chunk at its start; on a model with sliding-window layers, the pairs a
layer reads on average: engine/attention_shape.py), D the decode rows and K
the context those rows read (sum of start + 1, counted the same way), R the speculative draft rows and RK the context they
attend to (a draft row shares its decode row's reads of the cache but not its
arithmetic, so it costs a fraction of a decode row, growing with the context).
The fit is least squares over the last `window` steps with
prefill and, apart, the last `window` steps without, so a long run of decodes
does not push the prefill samples out; coefficients are kept non-negative
(a feature whose coefficient comes out negative is dropped and the rest
refitted), with a little ridge (relative to each feature's scale) so collinear
features (every prefill chunk the same size) still give an answer. A prediction
that is wrong shows in the next steps' times and corrects the fit; a step that
took several times what the fit says (a kernel compiled at first use, a pause)
is forgotten, unless many do (then the machine changed and the fit follows).

The fit is right on average, so half the steps planned to a target would
overrun it. Predictions are therefore scaled by a margin: the MARGIN_QUANTILE
of (time taken / time the fit predicted, before the step was added to it)
over the recent steps with prefill, between 1 and MAX_MARGIN. The target
then holds for about 97 steps in 100 instead of one in two: the server's goal
is its p99 step time while requests decode (the stats log's figure), and with
the 0.9 quantile one step in ten overran, by up to a third on a noisy VM.

Pure Python, no numpy: five features, solved lazily when a prediction is asked
for after new samples arrived."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable

from agentserve.engine.attention_shape import FULL, AttentionShape
from agentserve.engine.scheduler_output import ScheduledChunk

# Features are scaled to order-one values before fitting (conditioning only).
_SCALE = (1.0, 1.0 / 1024, 1.0 / 2**20, 1.0 / 64, 1.0 / 2**16, 1.0 / 16, 1.0 / 2**16)
_NF = len(_SCALE)
# a step this much slower than predicted (factor, then seconds on top) is a spike
SPIKE_FACTOR = 3.0
SPIKE_SLACK_S = 0.02
_MAX_CHUNK = 1 << 30
MARGIN_QUANTILE = 0.97
MAX_MARGIN = 2.0
_MIN_RATIOS = 8
# Until the model is fitted, a step with decodes computes at most this many
# smallest chunks of prefill (the first chunks run on cold kernels and caches).
COLD_CHUNKS = 4


def attention_pairs(start: int, n: int, shape: AttentionShape = FULL) -> float:
    """Query-key pairs of a chunk of `n` tokens after `start` cached ones (a
    layer's on average, on a model with sliding windows: engine/attention_shape.py)."""
    return shape.pairs(start, n)


def step_features(chunks: Iterable[ScheduledChunk],
                  shape: AttentionShape = FULL) -> tuple[int, float, int, float, int, int]:
    """(prefill tokens, attention pairs of the prefill chunks, decode rows, decode context,
    draft rows, draft context) of a step's chunks. The scheduler gathers the same as it
    schedules (StepBudget.features); this is for a step put together otherwise."""
    p = a = d = k = r = rk = 0
    for ch in chunks:
        if ch.is_decode:
            d += 1
            k += shape.context(ch.start + 1)
            if ch.draft:
                r += len(ch.draft)
                rk += draft_context(ch.start, len(ch.draft))
        else:
            p += ch.num_tokens
            a += shape.pairs(ch.start, ch.num_tokens)
    return p, a, d, k, r, rk


def draft_context(start: int, n: int) -> int:
    """Context the `n` draft rows after a decode at position `start` attend to."""
    return n * (start + 1) + n * (n + 1) // 2


class StepTimeModel:
    def __init__(self, window: int = 64, min_samples: int = 8, min_prefill_samples: int = 4,
                 shape: AttentionShape = FULL) -> None:
        self.window = window
        self.shape = shape  # the attention features' counting (engine/attention_shape.py)
        self.min_samples = min_samples
        self.min_prefill_samples = min_prefill_samples
        self._prefill: deque[tuple[tuple[float, ...], float]] = deque()
        self._decode: deque[tuple[tuple[float, ...], float]] = deque()
        self._xtx = [[0.0] * _NF for _ in range(_NF)]
        self._xty = [0.0] * _NF
        self._coef: tuple[float, ...] = (0.0,) * _NF  # unscaled: a, b, c, d, e, f, g
        self._dirty = False
        self._updates = 0
        self._ratios: deque[float] = deque(maxlen=window)  # taken / predicted, steps with prefill
        self._margin = 1.0

    # --- learning ---

    def observe(self, prefill_tokens: int, attention: int, decode_rows: int, decode_context: int,
                elapsed: float, draft_rows: int = 0, draft_context: int = 0) -> None:
        if not (prefill_tokens or decode_rows) or not (elapsed > 0 and math.isfinite(elapsed)):
            return
        if prefill_tokens and self.ready:
            fit = self._fit(prefill_tokens, attention, decode_rows, decode_context, draft_rows, draft_context)
            if fit > 0:
                self._ratios.append(elapsed / fit)
                self._margin = self._quantile_margin()
        x = tuple(f * s for f, s in zip((1, prefill_tokens, attention, decode_rows, decode_context, draft_rows,
                                         draft_context), _SCALE))
        win = self._prefill if prefill_tokens else self._decode
        win.append((x, elapsed))
        self._accumulate(x, elapsed, 1.0)
        if len(win) > self.window:
            old_x, old_y = win.popleft()
            self._accumulate(old_x, old_y, -1.0)
        self._dirty = True
        self._updates += 1
        if self._updates % 4096 == 0:  # wash out rounding from adding and subtracting
            self._rebuild()
        if self._updates % 16 == 0 and self.ready:
            self._drop_spikes()

    # --- learned state (kept over a restart by server/learned_state.py) ---

    def export_state(self) -> dict:
        """The fit's samples as plain data: the steps with and without prefill, each its
        features (as fitted: 1, P, A, D, K, R, RK, scaled) and seconds, oldest first, and the
        recent ratios of time taken to time predicted that set the margin."""
        return {"prefill": [[*x, y] for x, y in self._prefill], "decode": [[*x, y] for x, y in self._decode],
                "ratios": list(self._ratios)}

    def import_state(self, state: dict) -> None:
        """Replace the samples by exported ones (the newest `window` of each kind) and refit.
        ValueError (or TypeError, KeyError) on malformed data, changing nothing."""
        prefill = [_sample(row) for row in state["prefill"]][-self.window:]
        decode = [_sample(row) for row in state["decode"]][-self.window:]
        ratios = [float(r) for r in state["ratios"]]
        if not all(math.isfinite(r) and r > 0 for r in ratios):
            raise ValueError("a step-time ratio must be a finite number > 0")
        self._prefill = deque(prefill)
        self._decode = deque(decode)
        self._ratios = deque(ratios, maxlen=self.window)
        self._margin = self._quantile_margin()
        self._rebuild()
        self._updates = len(prefill) + len(decode)
        self._dirty = True

    def _quantile_margin(self) -> float:
        if len(self._ratios) < _MIN_RATIOS:
            return 1.0
        ordered = sorted(self._ratios)
        q = ordered[min(len(ordered) - 1, int(MARGIN_QUANTILE * len(ordered)))]
        return min(max(q, 1.0), MAX_MARGIN)

    @property
    def margin(self) -> float:
        """The factor predictions carry over the fit (see the module's docstring)."""
        return self._margin

    def _drop_spikes(self) -> None:
        """Forget isolated steps that took far longer than the fit says (a kernel
        compiled at first use, the machine busy elsewhere for a moment). At most an
        eighth of the samples: more is the machine changing, which the fit follows."""
        spikes = []
        for win in (self._prefill, self._decode):
            for item in win:
                x, y = item
                pred = self._fit(*(round(x[i] / _SCALE[i]) for i in range(1, _NF)))
                if y > SPIKE_FACTOR * pred + SPIKE_SLACK_S:
                    spikes.append((win, item))
        if not spikes or 8 * len(spikes) >= self.num_samples:
            return
        for win, item in spikes:
            win.remove(item)
            self._accumulate(item[0], item[1], -1.0)
        self._dirty = True

    def _accumulate(self, x: tuple[float, ...], y: float, sign: float) -> None:
        xtx, xty = self._xtx, self._xty
        for i in range(_NF):
            xi = sign * x[i]
            xty[i] += xi * y
            row = xtx[i]
            for j in range(i, _NF):
                row[j] += xi * x[j]

    def _rebuild(self) -> None:
        self._xtx = [[0.0] * _NF for _ in range(_NF)]
        self._xty = [0.0] * _NF
        for x, y in (*self._prefill, *self._decode):
            self._accumulate(x, y, 1.0)

    @property
    def num_samples(self) -> int:
        return len(self._prefill) + len(self._decode)

    @property
    def ready(self) -> bool:
        """Enough steps seen, prefill ones among them, to trust a prediction."""
        return len(self._prefill) >= self.min_prefill_samples and self.num_samples >= self.min_samples

    @property
    def coefficients(self) -> tuple[float, ...]:
        """(a seconds, b per prefill token, c per attention pair, d per decode row, e per context token)."""
        return self._all()[:5]

    @property
    def draft_coefficients(self) -> tuple[float, float]:
        """(f per draft row, g per context token a draft row attends to)."""
        return self._all()[5:]  # type: ignore[return-value]

    def _all(self) -> tuple[float, ...]:
        if self._dirty:
            self._coef = tuple(w * s for w, s in zip(self._solve(), _SCALE))
            self._dirty = False
        return self._coef

    def _solve(self) -> list[float]:
        full = [[self._xtx[min(i, j)][max(i, j)] for j in range(_NF)] for i in range(_NF)]
        # ridge relative to each feature's own scale (a feature never seen gets 0)
        ridge = [1e-6 * full[i][i] + 1e-12 for i in range(_NF)]
        active = list(range(_NF))
        w = [0.0] * _NF
        while active:
            m = [[full[i][j] + (ridge[i] if i == j else 0.0) for j in active] for i in active]
            sol = _solve_linear(m, [self._xty[i] for i in active])
            if sol is None:
                return [0.0] * _NF
            worst = min(range(len(active)), key=lambda k: sol[k])
            if sol[worst] >= 0:
                w = [0.0] * _NF
                for k, i in enumerate(active):
                    w[i] = sol[k]
                return w
            del active[worst]
        return w

    # --- predicting ---

    def _fit(self, prefill_tokens: int, attention: int, decode_rows: int, decode_context: int,
             draft_rows: int = 0, draft_context: int = 0) -> float:
        a, b, c, d, e, f, g = self._all()
        return a + b * prefill_tokens + c * attention + d * decode_rows + e * decode_context + f * draft_rows \
            + g * draft_context

    def predict(self, prefill_tokens: int, attention: int, decode_rows: int, decode_context: int) -> float:
        """A step's time: the fit times the margin."""
        return self._margin * self._fit(prefill_tokens, attention, decode_rows, decode_context)

    def base_time(self, decode_rows: int, decode_context: int, draft_rows: int = 0, draft_context: int = 0) -> float:
        """A step with these decodes (and drafts) and no prefill."""
        return self._margin * self._fit(0, 0, decode_rows, decode_context, draft_rows, draft_context)

    def draft_row_time(self, context: int) -> float:
        """What one more draft row attending to `context` tokens adds to a step."""
        f, g = self.draft_coefficients
        return self._margin * (f + g * context)

    def chunk_time(self, start: int, n: int) -> float:
        """What a prefill chunk of `n` tokens after `start` adds to a step."""
        _, b, c, _, _ = self.coefficients
        return self._margin * (b * n + c * self.shape.pairs(start, n))

    def max_chunk(self, start: int, seconds: float) -> int:
        """The longest prefill chunk after `start` tokens that adds at most `seconds`."""
        if seconds <= 0:
            return 0
        seconds_fit = seconds / self._margin
        _, b, c, _, _ = self.coefficients
        # c/2 n^2 + (b + c*(start + 1/2)) n <= seconds, solved in the form stable for c -> 0
        lin = b + c * (start + 0.5)
        disc = lin * lin + 2.0 * c * seconds_fit
        denom = lin + math.sqrt(disc)
        if denom <= 0:
            return _MAX_CHUNK
        n = int(2.0 * seconds_fit / denom)  # with full attention on every layer
        while n > 0 and self.chunk_time(start, n) > seconds:  # rounding at the boundary
            n -= 1
        if self.shape.window is not None and n < _MAX_CHUNK and self.chunk_time(start, n + 1) <= seconds:
            lo, hi = n + 1, _MAX_CHUNK  # windows read less: the longest chunk that fits, by bisection
            while lo < hi:
                mid = (lo + hi + 1) // 2
                lo, hi = (mid, hi) if self.chunk_time(start, mid) <= seconds else (lo, mid - 1)
            n = lo
        return min(n, _MAX_CHUNK)


def _sample(row) -> tuple[tuple[float, ...], float]:
    """One exported step sample: `_NF` features (the first 1.0) and the seconds it took."""
    values = [float(v) for v in row]
    if len(values) != _NF + 1 or values[0] != 1.0 or not all(math.isfinite(v) and v >= 0 for v in values) \
            or not values[-1] > 0:
        raise ValueError(f"a step-time sample must be {_NF} features >= 0 (the first 1) and seconds > 0, got {row!r}")
    return tuple(values[:-1]), values[-1]


def _solve_linear(m: list[list[float]], v: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting; None if singular."""
    n = len(v)
    a = [row[:] + [v[i]] for i, row in enumerate(m)]
    for col in range(n):
        piv = max(range(col, n), key=lambda r: abs(a[r][col]))
        if abs(a[piv][col]) < 1e-300:
            return None
        a[col], a[piv] = a[piv], a[col]
        p = a[col][col]
        for r in range(col + 1, n):
            f = a[r][col] / p
            if f:
                row, src = a[r], a[col]
                for k in range(col, n + 1):
                    row[k] -= f * src[k]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        s = a[r][n] - sum(a[r][k] * x[k] for k in range(r + 1, n))
        x[r] = s / a[r][r]
    return x
