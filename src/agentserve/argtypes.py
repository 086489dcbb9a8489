"""argparse value types the commands share."""

from __future__ import annotations

import argparse
import math


def csv_list(kind):
    """A comma-separated list of `kind` values, e.g. `--rates 0.5,1`."""
    def parse(s: str):
        try:
            vals = [kind(x.strip()) for x in s.split(",") if x.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list of {kind.__name__}, got {s!r}")
        if not vals:
            raise argparse.ArgumentTypeError("empty list")
        return vals
    return parse


def non_negative_ms(s: str) -> float:
    """Milliseconds, 0 or more (0 usually meaning: off)."""
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected milliseconds, got {s!r}") from None
    if not (v >= 0 and math.isfinite(v)):
        raise argparse.ArgumentTypeError(f"must be a number of milliseconds >= 0, got {s!r}")
    return v
