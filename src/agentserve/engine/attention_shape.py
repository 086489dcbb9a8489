"""How much attention a step's rows do on the model at hand: the step-time
model's attention features (engine/step_time.py) counted per kind of layer.

A layer with a sliding window of W positions reads at most W keys a query,
however long the context. On a model whose layers are mostly windowed
(Gemma 3: 15 of 18 layers, W = 512) the query-key pairs of a chunk late in a
32k prompt are a small fraction of what full attention on every layer would
read, so counting them as full would price long prompts several times too
high (chunks cut far smaller than the step-time target allows) and make the
fit's attention coefficient a blend of two costs. Features are therefore the
pairs a layer reads on average: the global layers' share of full pairs plus
the window layers' share of windowed pairs."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class AttentionShape:
    global_share: float = 1.0  # the share of layers that attend to the whole context
    window: int | None = None  # the other layers' sliding window

    def __post_init__(self) -> None:
        if not 0.0 <= self.global_share <= 1.0:
            raise ValueError(f"global_share must be in [0, 1], got {self.global_share}")
        if (self.window is None) != (self.global_share == 1.0) or (self.window is not None and self.window < 1):
            raise ValueError("a window (>= 1) is given exactly when some layers are windowed (global_share < 1)")

    @classmethod
    def of(cls, windows) -> "AttentionShape":
        """The shape of layers with these sliding windows (None: global); the
        windowed ones counted at their smallest window."""
        sizes = [w for w in windows if w is not None]
        if not sizes:
            return FULL
        return cls((len(windows) - len(sizes)) / len(windows), min(sizes))

    def pairs(self, start: int, n: int) -> float:
        """Query-key pairs a layer reads on average for a chunk of `n` tokens
        after `start` cached ones."""
        full = n * start + n * (n + 1) // 2
        if self.window is None:
            return full
        w = self.window
        k = min(max(w - start, 0), n)  # queries whose whole context is inside the window
        windowed = k * start + k * (k + 1) // 2 + (n - k) * w
        return self.global_share * full + (1.0 - self.global_share) * windowed

    def context(self, keys: int) -> float:
        """Keys a layer reads on average for a query with `keys` keys of context."""
        if self.window is None or keys <= self.window:
            return keys
        return self.global_share * keys + (1.0 - self.global_share) * self.window


FULL = AttentionShape()
