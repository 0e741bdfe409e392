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


def estimate_prompt_tokens(body: dict[str, Any]) -> int:
    """Prompt tokens of a chat (`messages`) or completion (`prompt`) request body."""
    messages = body.get("messages")
    if isinstance(messages, list):
        tokens = 0
        for m in messages:
            if isinstance(m, dict):
                content = m.get("content")
                tokens += _PER_MESSAGE_OVERHEAD + estimate_text_tokens(
                    content if isinstance(content, str) else _content_text(content))
        return tokens
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return estimate_text_tokens(prompt)
    if isinstance(prompt, list):
        if all(isinstance(p, int) for p in prompt):
            return len(prompt)  # already token ids
        return sum(estimate_text_tokens(p) for p in prompt if isinstance(p, str))
    return 0
