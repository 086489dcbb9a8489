"""Known turn formats for model files that carry no chat template.

A base model's GGUF (the Gemma 3 270M file is one) has no
`tokenizer.chat_template`. Rendering its chats as ChatML, the server's general
fallback, would write `<|im_start|>` as plain text the model never saw; its
family's own turn markers are what it was trained around. So a model without
a template gets its family's format here, with one log line saying so; a
family with no format known here keeps ChatML (also with one log line).

A family's end-of-turn token also ends generation, template or not: Gemma
files name `<eos>` as their EOS, but a Gemma turn ends with `<end_of_turn>`,
and without it among the stop ids a reply would run on into a made-up next
turn (llama.cpp stops on it the same way).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from agentserve.runner.checkpoint import LoadedModel
from agentserve.runner.tokenizer import Tokenizer

log = logging.getLogger("agentserve")

# Gemma's turns: `<start_of_turn>{user|model}\n{text}<end_of_turn>\n` after BOS.
# Gemma has no system role: a leading system message is written at the top of
# the first turn, a blank line before that turn's own text; a system message
# alone becomes the one user turn. Gemma has no tool role either: tool results
# (already wrapped in <tool_response> by the Hermes tools fallback, since this
# template does not take `tools`) are user turns. Text is trimmed, as Gemma's
# own template does.
GEMMA_TEMPLATE = (
    "{{ bos_token }}"
    "{% set rest = messages %}{% set preamble = '' %}"
    "{% if messages[0]['role'] == 'system' %}"
    "{% set preamble = messages[0]['content'] | trim %}"
    "{% set rest = messages[1:] %}"
    "{% if not rest %}{{ '<start_of_turn>user\n' + preamble + '<end_of_turn>\n' }}{% endif %}"
    "{% endif %}"
    "{% for m in rest %}"
    "{% set text = m['content'] | trim %}"
    "{% if loop.first and preamble %}{% set text = preamble + '\n\n' + text %}{% endif %}"
    "{{ '<start_of_turn>' + ('model' if m['role'] == 'assistant' else 'user') + '\n' + text + '<end_of_turn>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)


@dataclass(frozen=True)
class ChatFormat:
    family: str
    template: str
    end_of_turn: str  # the token that closes a turn: generation stops on it
    markers: tuple[str, ...]  # tokens the format writes; each must be one token of the vocabulary


FORMATS = {
    "gemma": ChatFormat("gemma", GEMMA_TEMPLATE, "<end_of_turn>", ("<start_of_turn>", "<end_of_turn>")),
}
# Architecture (GGUF general.architecture, or config.json model_type) -> family.
FAMILIES = {"gemma": "gemma", "gemma2": "gemma", "gemma3": "gemma"}


def format_for(arch: str | None, tokenizer: Tokenizer) -> ChatFormat | None:
    """The known format of `arch`'s family, if its markers are tokens of this vocabulary
    (a file whose vocabulary lacks them is not the family's, whatever it says)."""
    fmt = FORMATS.get(FAMILIES.get(arch or "", ""))
    if fmt is None or any(tokenizer.token_to_id(t) is None for t in fmt.markers):
        return None
    return fmt


def apply_chat_format(loaded: LoadedModel, arch: str | None) -> None:
    """Give a model without a chat template its family's format, and make its
    family's end-of-turn token end generation (in the tokenizer's and the
    config's EOS ids, which the engine stops on)."""
    fmt = format_for(arch, loaded.tokenizer)
    if fmt is None:
        if loaded.chat_template is None:
            log.info("%s has no chat template and no turn format is known for its architecture (%s): "
                     "chats are written as ChatML", loaded.source, arch)
        return
    if loaded.chat_template is None:
        loaded.chat_template = fmt.template
        log.info("%s has no chat template: chats are written in the %s turn format (%s ... %s)",
                 loaded.source, fmt.family, *fmt.markers)
    eot = loaded.tokenizer.token_to_id(fmt.end_of_turn)
    if eot not in loaded.tokenizer.eos_token_ids:
        loaded.tokenizer.eos_token_ids.append(eot)
    # an empty config list defers to the tokenizer's (LLM takes the first non-empty)
    if loaded.config.eos_token_ids and eot not in loaded.config.eos_token_ids:
        loaded.config.eos_token_ids.append(eot)
