"""Token estimates without a tokenizer (pure).

BPE tokenizers of current models give roughly 4 characters of English text per token, and
about one token per CJK character (Chinese tickets are close to 1 token a character, often a
little more). The estimate counts CJK characters (and other wide scripts) as one token each and
everything else as a quarter token, rounded up. It errs high on Chinese rather than low, which
is the safe side for capacity decisions.

A prompt is read where the engine reads it for the API the path names: a chat's `messages`
(each message's text, its `tool_calls`, and the request's `tools`, which the chat template
writes into the prompt, as JSON text), a completion's `prompt`. The engine ignores a field of
the other API beside them, and so does the estimate: `"messages": []` beside a long `prompt` on
/v1/completions costs that prompt.
"""

from __future__ import annotations

import json
import re
from typing import Any

from .openai_request import Api, too_deep

_PER_MESSAGE_OVERHEAD = 4  # role markers and separators of a chat template
# A content part that is not text (an image, audio, a video): its tokens depend on the model and
# the input. Set high rather than low: a 1024x1024 picture is 576 tokens on LLaVA-1.5 and 1,369
# on Qwen2-VL (some models take more: Pixtral 4,096).
_NON_TEXT_PART_TOKENS = 1500


# CJK radicals, kana and unified ideographs; Hangul syllables; CJK compatibility ideographs;
# full-width forms; CJK extensions. Counted by the regex engine: this runs on every request.
_WIDE = re.compile("[\u2e80-\u9fff\uac00-\ud7af\uf900-\ufaff\uff00-\uffef\U00020000-\U0003ffff]+")


def estimate_text_tokens(text: str) -> int:
    if text.isascii():  # (known without reading the text: no wide character in it)
        return (len(text) + 3) // 4
    wide = len(text) - len(_WIDE.sub("", text))
    narrow = len(text) - wide
    return wide + (narrow + 3) // 4


def _parts_tokens(content: Any) -> int:
    """A message's content that is not one text: parts ([{"type": "text", "text": ...}, {"type": "image_url", ...}])."""
    if not isinstance(content, list):
        return 0
    texts = []
    others = 0
    for part in content:
        if isinstance(part, dict) and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif isinstance(part, str):
            texts.append(part)
        else:
            others += 1
    return estimate_text_tokens(" ".join(texts)) + others * _NON_TEXT_PART_TOKENS


def _json_tokens(value: Any) -> int:
    """A value the chat template writes as JSON (`tools`, `tool_calls`), estimated as its text.
    Raises a 400 Rejection for a value nested too deep to write here."""
    try:
        return estimate_text_tokens(json.dumps(value, ensure_ascii=False))
    except RecursionError:
        raise too_deep() from None


def _chat_tokens(body: dict[str, Any]) -> int:
    tokens = 0
    messages = body.get("messages")
    if isinstance(messages, list):
        for m in messages:
            if isinstance(m, dict):
                content = m.get("content")
                tokens += _PER_MESSAGE_OVERHEAD + (
                    estimate_text_tokens(content) if isinstance(content, str) else _parts_tokens(content))
                if m.get("tool_calls") is not None:  # (their arguments are text the model reads)
                    tokens += _json_tokens(m["tool_calls"])
    if body.get("tools") is not None:
        tokens += _json_tokens(body["tools"])
    return tokens


def _prompt_tokens(prompt: Any) -> int:
    """One prompt of a completion: a text, or token ids (a token each)."""
    if isinstance(prompt, str):
        return estimate_text_tokens(prompt)
    return len(prompt) if isinstance(prompt, list) else 0


def _completion_prompts(body: dict[str, Any]) -> tuple[int, int, int]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and not all(isinstance(p, int) for p in prompt):
        each = [_prompt_tokens(p) for p in prompt]
        return sum(each), len(each), max(each)
    tokens = _prompt_tokens(prompt)
    return tokens, 1, tokens


def estimate_prompts(body: dict[str, Any], api: str = Api.OTHER) -> tuple[int, int, int]:
    """The prompts of a request body for `api`: their tokens together, how many the engine runs
    apart, and the longest one's tokens (each runs in a context of its own). A chat is one
    prompt. A completion's `prompt` is one text, one list of token ids, or a batch of either (a
    list of texts, a list of lists of token ids), each of whose prompts the engine runs as a
    request of its own. Another API's body is read both ways, and the larger reading counts.
    (A plain tuple: this runs on every request.)"""
    if api == Api.CHAT:
        tokens = _chat_tokens(body)
        return tokens, 1, tokens
    prompts = _completion_prompts(body)
    if api == Api.COMPLETIONS:
        return prompts
    tokens = _chat_tokens(body)
    return prompts if prompts[0] > tokens else (tokens, 1, tokens)


def estimate_prompt_tokens(body: dict[str, Any], api: str = Api.OTHER) -> int:
    """Prompt tokens of a request body for `api`, all together."""
    return estimate_prompts(body, api)[0]
