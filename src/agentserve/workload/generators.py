"""Synthetic agent workloads matching the CacheTTL paper's Table 2 (mean, std).

| workload                   | turns      | tool time ms  | tokens per program |
|----------------------------|------------|---------------|--------------------|
| SWE-bench (mini-swe-agent) | 10.9, 2.1  | 925, 3550     | 70126, 19732       |
| BFCL v4 web search         | 6.3, 2.3   | 1923, 2133    | 93256, 68687       |

Model of one program (all draws from a per-program RNG seeded by
(seed, workload, index), so program i does not depend on how many programs
are generated or on the arrival rate):

* turns n: a discretised normal on [min_turns, ...] whose mean/std are solved
  to equal the table exactly.
* call 0's prompt = shared system prompt (`shared_prefix_tokens`, the same for
  every program) + a task prompt drawn uniformly from a range.
* outputs: lognormal per call (SWE-bench: a THOUGHT + one bash block, mean 250;
  BFCL mean 150).
* call k+1's prompt = call k's prompt + call k's output + a tool observation
  (pure append: new_tokens = the observation).
* "tokens per program" = sum of the prompts. Given n, the first prompt and the
  outputs, the observations only add Y = sum_j obs_j * (n-1-j). We draw
  Y = g * B(n)**alpha with B(n) = n(n-1)/2 (the observation-turn count) and g a
  gamma variate whose mean and std are solved in closed form so the sum matches
  the table's mean and std; alpha = 1 is "a per-program growth per turn" and is
  used when feasible, else the largest alpha (step 0.05) that leaves g a
  coefficient of variation >= 0.25 (SWE-bench: n's spread alone would otherwise
  overshoot the table's token std; solved: SWE-bench alpha 0.5, BFCL 0.95). Y is split over the observations with
  lognormal weights, so observation sizes vary turn by turn.
* tools: each call but the last names a tool drawn from a small weighted set;
  each tool's duration is a mixture of lognormals. One shape parameter (the
  slow-run median for SWE-bench, fetch_url's sigma for BFCL) is solved so the
  mixture's CV matches the table, then all durations are scaled to its mean.
  The last call has tool_name None and tool_duration 0.
* arrivals: Poisson at `rate` programs/s (first arrival after the first gap).
  Later calls' `arrival` = turn-0 arrival + the preceding tool durations
  (a zero-LLM-latency lower bound; informational, replays use tool_duration).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Callable, Sequence

from .trace import Program, TraceCall

# ---------------------------------------------------------------------------
# distributions


def _discrete_normal_pmf(mean: float, std: float, lo: int) -> tuple[list[int], list[float]]:
    """A discretised normal on integers >= lo with exactly this mean and std."""
    hi = int(math.ceil(mean + 8 * std)) + 1
    ks = list(range(lo, hi + 1))
    mu, sigma = mean, std
    for _ in range(200):
        w = [math.exp(-0.5 * ((k - mu) / sigma) ** 2) for k in ks]
        z = sum(w)
        p = [x / z for x in w]
        m = sum(k * q for k, q in zip(ks, p))
        s = math.sqrt(sum((k - m) ** 2 * q for k, q in zip(ks, p)))
        if abs(m - mean) < 1e-9 and abs(s - std) < 1e-9:
            break
        mu += mean - m
        sigma *= std / s
    return ks, p


@dataclass(frozen=True)
class ToolModel:
    """A tool's duration in ms: a mixture of lognormals (prob, median_ms, sigma)."""

    name: str
    weight: float
    components: tuple[tuple[float, float, float], ...]

    def moment(self, k: int) -> float:
        return sum(p * m**k * math.exp(k * k * s * s / 2) for p, m, s in self.components)

    def scaled(self, c: float) -> "ToolModel":
        return replace(self, components=tuple((p, m * c, s) for p, m, s in self.components))

    def sample_ms(self, rng: random.Random) -> float:
        u = rng.random()
        for p, m, s in self.components:
            u -= p
            if u < 0:
                break
        return rng.lognormvariate(math.log(m), s)


def _mixture_moments(tools: Sequence[ToolModel]) -> tuple[float, float]:
    wsum = sum(t.weight for t in tools)
    m1 = sum(t.weight * t.moment(1) for t in tools) / wsum
    m2 = sum(t.weight * t.moment(2) for t in tools) / wsum
    return m1, math.sqrt(max(0.0, m2 - m1 * m1))


def fit_tools(
    make: Callable[[float], Sequence[ToolModel]], lo: float, hi: float, mean_ms: float, std_ms: float
) -> tuple[ToolModel, ...]:
    """Solve the shape parameter theta in [lo, hi] (CV increasing in theta) so
    the tool mixture has CV = std/mean, then scale every duration to `mean_ms`."""
    target = std_ms / mean_ms

    def cv(theta: float) -> float:
        m, s = _mixture_moments(make(theta))
        return s / m

    if not cv(lo) <= target <= cv(hi):
        raise ValueError(f"tool model cannot reach CV {target:.3f} in [{cv(lo):.3f}, {cv(hi):.3f}]")
    a, b = lo, hi
    for _ in range(200):
        mid = 0.5 * (a + b)
        if cv(mid) < target:
            a = mid
        else:
            b = mid
    tools = make(0.5 * (a + b))
    m, _ = _mixture_moments(tools)
    return tuple(t.scaled(mean_ms / m) for t in tools)


# ---------------------------------------------------------------------------
# workload specs


@dataclass(frozen=True)
class WorkloadSpec:
    name: str
    turns_mean: float
    turns_std: float
    min_turns: int
    tool_ms_mean: float
    tool_ms_std: float
    tokens_mean: float  # sum over calls of prompt tokens
    tokens_std: float
    shared_prefix_tokens: int
    task_tokens: tuple[int, int]  # uniform range of the task part of call 0's prompt
    output_mean: float
    output_sigma: float  # lognormal sigma of output lengths
    obs_sigma: float  # lognormal sigma of the split of observation tokens over turns
    tools: tuple[ToolModel, ...]


def _swebench_tools(theta: float) -> list[ToolModel]:
    # First word of mini-swe-agent bash blocks. Most commands are short; test and
    # script runs (python ..., cd repo && python -m pytest ...) form a slow
    # component whose median theta is solved for the table's long tail.
    slow = 0.9
    return [
        ToolModel("cat", 0.18, ((1.0, 120, 0.5),)),
        ToolModel("grep", 0.13, ((1.0, 180, 0.6),)),
        ToolModel("sed", 0.12, ((1.0, 120, 0.4),)),
        ToolModel("ls", 0.06, ((1.0, 100, 0.4),)),
        ToolModel("find", 0.06, ((1.0, 250, 0.7),)),
        ToolModel("echo", 0.04, ((1.0, 80, 0.3),)),
        ToolModel("head", 0.03, ((1.0, 100, 0.4),)),
        ToolModel("python", 0.12, ((0.65, 700, 0.6), (0.35, theta, slow))),
        ToolModel("cd", 0.26, ((0.8, 200, 0.6), (0.2, theta, slow))),
    ]


def _bfcl_tools(theta: float) -> list[ToolModel]:
    # BFCL v4 web search: search queries are fairly steady, page fetches
    # long-tailed (their sigma theta is solved).
    return [
        ToolModel("web_search", 0.6, ((1.0, 1000, 0.5),)),
        ToolModel("fetch_url", 0.4, ((1.0, 1000, theta),)),
    ]


@lru_cache(maxsize=None)
def workload_spec(name: str) -> WorkloadSpec:
    if name == "swebench":
        return WorkloadSpec(
            name="swebench", turns_mean=10.9, turns_std=2.1, min_turns=2,
            tool_ms_mean=925.0, tool_ms_std=3550.0, tokens_mean=70126.0, tokens_std=19732.0,
            shared_prefix_tokens=1000, task_tokens=(500, 1500), output_mean=250.0, output_sigma=0.35,
            obs_sigma=1.0, tools=fit_tools(_swebench_tools, 1000.0, 1e6, 925.0, 3550.0),
        )
    if name == "bfcl":
        return WorkloadSpec(
            name="bfcl", turns_mean=6.3, turns_std=2.3, min_turns=2,
            tool_ms_mean=1923.0, tool_ms_std=2133.0, tokens_mean=93256.0, tokens_std=68687.0,
            shared_prefix_tokens=800, task_tokens=(700, 1700), output_mean=150.0, output_sigma=0.5,
            obs_sigma=1.0, tools=fit_tools(_bfcl_tools, 0.05, 3.0, 1923.0, 2133.0),
        )
    raise ValueError(f"unknown generated workload {name!r} (choices: swebench, bfcl)")


@dataclass(frozen=True)
class _TokenModel:
    turns: tuple[list[int], list[float]]
    cum_weights: list[float]
    alpha: float
    g_mean: float
    g_std: float


@lru_cache(maxsize=None)
def _token_model(name: str) -> _TokenModel:
    """Closed-form solve of the observation-growth distribution (see module doc)."""
    spec = workload_spec(name)
    ks, ps = _discrete_normal_pmf(spec.turns_mean, spec.turns_std, spec.min_turns)
    a, b = spec.task_tokens
    mu_p = spec.shared_prefix_tokens + (a + b) / 2
    var_p = ((b - a + 1) ** 2 - 1) / 12
    mu_o = spec.output_mean
    var_o = mu_o**2 * (math.exp(spec.output_sigma**2) - 1)
    ex = {n: n * mu_p + mu_o * n * (n - 1) / 2 for n in ks}
    vx = {n: n * n * var_p + var_o * (n - 1) * n * (2 * n - 1) / 6 for n in ks}
    target_m, target_v = spec.tokens_mean, spec.tokens_std**2
    alpha = 1.0
    while True:
        bn = {n: (n * (n - 1) / 2) ** alpha for n in ks}
        e_b = sum(p * bn[n] for n, p in zip(ks, ps))
        e_b2 = sum(p * bn[n] ** 2 for n, p in zip(ks, ps))
        g_mean = (target_m - sum(p * ex[n] for n, p in zip(ks, ps))) / e_b
        if g_mean <= 0:
            raise ValueError(f"{name}: the first prompts and outputs alone exceed the token target")
        base = sum(p * (vx[n] + (ex[n] + g_mean * bn[n]) ** 2) for n, p in zip(ks, ps)) - target_m**2
        g_var = (target_v - base) / e_b2
        if g_var >= (0.25 * g_mean) ** 2 or alpha <= 0:
            break
        alpha = round(alpha - 0.05, 10)
    g_std = math.sqrt(max(0.0, g_var))
    cum, acc = [], 0.0
    for p in ps:
        acc += p
        cum.append(acc)
    return _TokenModel((ks, ps), cum, alpha, g_mean, g_std)


# ---------------------------------------------------------------------------
# generation


def _poisson_arrivals(n: int, rate: float, rng: random.Random) -> list[float]:
    if rate <= 0 or math.isnan(rate):
        raise ValueError(f"rate must be > 0 programs/s, got {rate}")
    out, t = [], 0.0
    for _ in range(n):
        if not math.isinf(rate):
            t += rng.expovariate(rate)
        out.append(t)
    return out


def _gamma(rng: random.Random, mean: float, std: float) -> float:
    if std <= 0:
        return mean
    k = (mean / std) ** 2
    return rng.gammavariate(k, std * std / mean)


def _generate_program(spec: WorkloadSpec, model: _TokenModel, pid: str, arrival: float,
                      rng: random.Random) -> Program:
    ks, _ = model.turns
    n = rng.choices(ks, cum_weights=model.cum_weights)[0]
    a, b = spec.task_tokens
    p0 = spec.shared_prefix_tokens + rng.randint(a, b)
    mu_log = math.log(spec.output_mean) - spec.output_sigma**2 / 2
    outs = [max(1, round(rng.lognormvariate(mu_log, spec.output_sigma))) for _ in range(n)]
    y = _gamma(rng, model.g_mean, model.g_std) * (n * (n - 1) / 2) ** model.alpha
    u = [rng.lognormvariate(0.0, spec.obs_sigma) for _ in range(n - 1)]
    scale = y / sum(uj * (n - 1 - j) for j, uj in enumerate(u))
    obs = [max(1, round(uj * scale)) for uj in u]
    names = [t.name for t in spec.tools]
    weights = [t.weight for t in spec.tools]
    by_name = {t.name: t for t in spec.tools}
    calls: list[TraceCall] = []
    prompt, t_arr = p0, arrival
    for k in range(n):
        last = k == n - 1
        if last:
            tool, dur = None, 0.0
        else:
            tool = rng.choices(names, weights)[0]
            dur = round(by_name[tool].sample_ms(rng)) / 1000.0  # whole ms
        calls.append(TraceCall(
            program_id=pid, turn=k, arrival=t_arr, prompt_tokens=prompt,
            new_tokens=p0 if k == 0 else obs[k - 1], output_tokens=outs[k],
            tool_name=tool, tool_duration=dur, shared_prefix_tokens=spec.shared_prefix_tokens,
        ))
        if not last:
            prompt += outs[k] + obs[k]
            t_arr += dur
    return Program(pid, calls)


def generate(name: str, num_programs: int, rate: float, seed: int) -> list[Program]:
    """`num_programs` programs of workload `name` ("swebench" or "bfcl")."""
    spec = workload_spec(name)
    model = _token_model(name)
    arrivals = _poisson_arrivals(num_programs, rate, random.Random(f"{seed}:{name}:arrivals"))
    return [
        _generate_program(spec, model, f"{name}-s{seed}-{i:05d}", arrivals[i], random.Random(f"{seed}:{name}:{i}"))
        for i in range(num_programs)
    ]


def generate_swebench(num_programs: int, rate: float, seed: int) -> list[Program]:
    """SWE-bench / mini-swe-agent programs (Table 2 row 1); Poisson arrivals at `rate`/s."""
    return generate("swebench", num_programs, rate, seed)


def generate_bfcl(num_programs: int, rate: float, seed: int) -> list[Program]:
    """BFCL v4 web-search programs (Table 2 row 2); Poisson arrivals at `rate`/s."""
    return generate("bfcl", num_programs, rate, seed)


# ---------------------------------------------------------------------------
# arrivals for loaded traces


def assign_poisson_arrivals(programs: list[Program], rate: float, seed: int) -> list[Program]:
    """New Program objects whose groups arrive as a Poisson process at `rate`/s.

    A group is a top-level program plus its subagents (Program.parent_id, or an
    id "parent:sub"). Groups get arrivals in list order; every call of a group
    is shifted by the same amount, so subagents keep their recorded offset from
    their parent. A subagent whose parent is absent is its own group. The input
    is not modified (calls are shallow-copied; hash_ids/messages lists shared).
    Returned sorted by arrival (stable)."""
    ids = {p.program_id for p in programs}
    roots: list[str] = []
    members: dict[str, list[Program]] = {}
    for p in programs:
        g = p.group_id if p.group_id in ids else p.program_id
        if g not in members:
            members[g] = []
            roots.append(g)
        members[g].append(p)
    times = _poisson_arrivals(len(roots), rate, random.Random(f"{seed}:arrivals"))
    out: list[Program] = []
    for g, t in zip(roots, times):
        group = members[g]
        root = next((p for p in group if p.program_id == g), group[0])
        delta = t - root.arrival
        for p in group:
            calls = [replace(c, arrival=c.arrival + delta) for c in p.calls]
            out.append(replace(p, calls=calls))
    out.sort(key=lambda p: p.arrival)
    return out
