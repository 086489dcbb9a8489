"""Text of a given token length for the replay: deterministic filler (seeded
common words), and the `TextModel` that says how many tokens filler text and a
chat message take on the target server, calibrated with three probe
requests."""

from __future__ import annotations

import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from agentserve.bench.replay_stream import ReplayError


WORDS = (
    "the of and to in is that for it as with was on be by this are from at or an have not which one but all "
    "were when there can more if will each about how up out them then she many some so these would other into "
    "has her two like him see time could no make than first been its who now people my made over did down only "
    "way find use may water long little very after words called just where most know get through back much go "
    "good new write our me man too any day same right look think also around another came come work three word "
    "must because does part even place well such here take why things help put years different away again off "
    "went old number great tell men say small every found still between name should home big give air line set "
    "own under read last never us left end along while might next sound below saw something thought both few "
    "those always looked show large often together asked house world going want school important until form food "
    "keep children feet land side without boy once animals life enough took sometimes four head above kind began "
    "almost live page got earth need far hand high year mother light parts country father let night following "
    "picture being study second eyes soon times story boys since white days ever paper hard near sentence better "
    "best across during today others however sure means knew its try told young miles sun ways thing whole hear "
    "example heard several change answer room sea against top turned learn point city play toward five using "
    "himself usually file function return value test error module class import string list table index field "
    "server request program result output input config parser method object default option branch commit patch"
).split()


def filler_text(n_words: int, seed: str) -> str:
    """`n_words` (>= 1) seeded common words, a line break every 16 words."""
    rng = random.Random(seed)
    words = [rng.choice(WORDS) for _ in range(max(1, n_words))]
    return "\n".join(" ".join(words[i:i + 16]) for i in range(0, len(words), 16))


@dataclass(frozen=True)
class TextModel:
    """How many tokens filler text and chat messages take on the target server."""

    tokens_per_word: float
    message_overhead: float = 4.0  # template tokens a message adds beyond its content

    def words_for(self, tokens: float) -> int:
        """Words of filler for a message of `tokens` tokens, template included (>= 1)."""
        return max(1, round((tokens - self.message_overhead) / self.tokens_per_word))

    def text(self, tokens: float, seed: str) -> str:
        return filler_text(self.words_for(tokens), seed)


# probe sizes (words): base/more use W_A, longer W_B
W_A, W_SYS = 16, 8


def probe_messages(w_b: int) -> dict[str, list[dict]]:
    """The three calibration prompts: base = [system X, user Y_a]; longer = the
    user message of w_b words; more = base + [assistant Y_a, user Y_a]."""
    sys_text = filler_text(W_SYS, "calibrate:system")
    y_a = filler_text(W_A, "calibrate:user")
    y_b = filler_text(w_b, "calibrate:user")  # same seed: Y_a's words are Y_b's first words
    base = [{"role": "system", "content": sys_text}, {"role": "user", "content": y_a}]
    return {
        "base": base,
        "longer": [base[0], {"role": "user", "content": y_b}],
        "more": base + [{"role": "assistant", "content": y_a}, {"role": "user", "content": y_a}],
    }


def fit_text_model(counts: dict[str, int], w_b: int) -> TextModel:
    """TextModel from the probes' prompt token counts:
    tokens/word = (longer - base) / (w_b - W_A); overhead = ((more - base) - 2 W_A tpw) / 2."""
    tpw = (counts["longer"] - counts["base"]) / (w_b - W_A)
    if not tpw > 0:
        raise ReplayError(f"calibration failed: prompt tokens did not grow with the text ({counts}); "
                          "pass --tokens-per-word")
    overhead = ((counts["more"] - counts["base"]) - 2 * W_A * tpw) / 2
    return TextModel(tpw, max(0.0, overhead))


def probe_words(max_context: int | None) -> int:
    """w_b: 112 words, fewer for a small context (the longer probe stays well inside it)."""
    if max_context is None:
        return 112
    return max(W_A + 16, min(112, max_context // 10))


async def calibrate(count_prompt: Callable[[list[dict]], Awaitable[int]],
                    max_context: int | None = None) -> TextModel:
    """Measure the TextModel with `count_prompt` (messages -> prompt tokens)."""
    w_b = probe_words(max_context)
    counts = {name: int(await count_prompt(msgs)) for name, msgs in probe_messages(w_b).items()}
    return fit_text_model(counts, w_b)
