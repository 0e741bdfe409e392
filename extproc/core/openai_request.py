"""Parsing the OpenAI-style request body the sidecar needs to decide on (pure)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from .outcomes import Outcome, Rejection


@dataclass(frozen=True, slots=True)
class CompletionRequest:
    body: dict[str, Any]
    model: str | None
    stream: bool
    max_tokens: int | None


_DECODER = json.JSONDecoder()


def _object(text: str) -> object:
    """`json.loads(text)` for a text that starts with "{": the same value, the same errors."""
    value, end = _DECODER.raw_decode(text)
    if end != len(text) and text[end:].strip(" \t\n\r"):  # JSON's whitespace, and nothing else, may follow
        raise json.JSONDecodeError("Extra data", text, len(text) - len(text[end:].lstrip(" \t\n\r")))
    return value


def _bad(message: str, param: str | None = None) -> Rejection:
    where = f" ({param})" if param else ""
    return Rejection(Outcome.REJECTED_BAD_REQUEST, f"{message}{where}")


def check_size(size: int, max_body_bytes: int) -> None:
    if size > max_body_bytes:
        raise Rejection(
            Outcome.REJECTED_TOO_LARGE,
            f"Request body of {size} bytes exceeds the limit of {max_body_bytes} bytes.",
        )


def parse_completion_request(raw: bytes, max_body_bytes: int) -> CompletionRequest:
    check_size(len(raw), max_body_bytes)
    try:
        # An object's first byte "{" and a second byte that is not 0: UTF-8, as json.loads would
        # detect (it decodes with "surrogatepass" too); anything else is left to it.
        if raw[:1] == b"{" and raw[1:2] != b"\x00":
            body = _object(raw.decode("utf-8", "surrogatepass"))
        else:
            body = json.loads(raw)
    except UnicodeDecodeError:
        raise _bad("Request body is not valid UTF-8.") from None
    except json.JSONDecodeError as error:
        raise _bad(f"Request body is not valid JSON: {error.msg} at position {error.pos}.") from None
    except RecursionError:
        raise _bad("Request body nests too deeply.") from None
    if not isinstance(body, dict):
        raise _bad("Request body must be a JSON object.")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise _bad("'model' must be a string.", "model")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise _bad("'stream' must be a boolean.", "stream")
    if "messages" in body and not isinstance(body["messages"], list):
        raise _bad("'messages' must be an array.", "messages")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is not None and (
        isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1
    ):
        raise _bad("'max_tokens' must be a positive integer.", "max_tokens")
    return CompletionRequest(body, model, stream, max_tokens)


def rewritten(request: CompletionRequest, **fields: Any) -> bytes:
    """The body re-encoded with `fields` set (e.g. a fallback `model`, an engine `priority`)."""
    return json.dumps({**request.body, **fields}, ensure_ascii=False).encode()
