"""Token estimates without a tokenizer (pure).

BPE tokenizers of current models give roughly 4 characters of English text per token, and
about one token per CJK character (Chinese tickets are close to 1 token a character, often a
little more). The estimate counts CJK characters (and other wide scripts) as one token each and
everything else as a quarter token, rounded up. It errs high on Chinese rather than low, which
is the safe side for capacity decisions.
"""

from __future__ import annotations

import re
from typing import Any

_PER_MESSAGE_OVERHEAD = 4  # role markers and separators of a chat template


# CJK radicals, kana and unified ideographs; Hangul syllables; CJK compatibility ideographs;
# full-width forms; CJK extensions. Counted by the regex engine: this runs on every request.
_WIDE = re.compile("[\u2e80-\u9fff\uac00-\ud7af\uf900-\ufaff\uff00-\uffef\U00020000-\U0003ffff]+")


def estimate_text_tokens(text: str) -> int:
    if text.isascii():  # (known without reading the text: no wide character in it)
        return (len(text) + 3) // 4
    wide = len(text) - len(_WIDE.sub("", text))
    narrow = len(text) - wide
    return wide + (narrow + 3) // 4


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
        return " ".join(
            part.get("text", "") for part in content if isinstance(part, dict) and isinstance(part.get("text"), str)
        )
    return ""


def _chat_tokens(messages: list) -> int:
    tokens = 0
    for m in messages:
        if isinstance(m, dict):
            content = m.get("content")
            tokens += _PER_MESSAGE_OVERHEAD + estimate_text_tokens(
                content if isinstance(content, str) else _content_text(content))
    return tokens


def _prompt_tokens(prompt: Any) -> int:
    """One prompt of a completion: a text, or token ids (a token each)."""
    if isinstance(prompt, str):
        return estimate_text_tokens(prompt)
    return len(prompt) if isinstance(prompt, list) else 0


def estimate_prompts(body: dict[str, Any]) -> tuple[int, int, int]:
    """The prompts of a chat (`messages`) or completion (`prompt`) request body: their tokens
    together, how many the engine runs apart, and the longest one's tokens (each runs in a
    context of its own). A chat is one prompt. A completion's `prompt` is one text, one list
    of token ids, or a batch of either (a list of texts, a list of lists of token ids), each of
    whose prompts the engine runs as a request of its own. (A plain tuple: this runs on every
    request.)"""
    messages = body.get("messages")
    if isinstance(messages, list):
        tokens = _chat_tokens(messages)
        return tokens, 1, tokens
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and not all(isinstance(p, int) for p in prompt):
        each = [_prompt_tokens(p) for p in prompt]
        return sum(each), len(each), max(each)
    tokens = _prompt_tokens(prompt)
    return tokens, 1, tokens


def estimate_prompt_tokens(body: dict[str, Any]) -> int:
    """Prompt tokens of a chat (`messages`) or completion (`prompt`) request body, all together."""
    return estimate_prompts(body)[0]
