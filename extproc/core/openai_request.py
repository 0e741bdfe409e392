"""Parsing the OpenAI-style request body the sidecar needs to decide on (pure).

The body is checked for what would stop it being sent on as it is or re-encoded (a string that
is not Unicode, a number Python cannot read or a float cannot hold, a value JSON does not know),
and for the fields its cost depends on, read as vLLM reads them for the API its path names: a
field set to null is absent; `max_completion_tokens` wins over `max_tokens` in a chat; `n` (and
`best_of`, where larger) sequences are sampled for each prompt.

A body the sidecar sends on with only `max_tokens` written in (a chat that sets no bound, the
openai SDK's default) is not re-encoded: the field is spliced in before the object's closing
brace. A key given twice reads as its last value in Python's json (FastAPI's, vLLM's) and in
pydantic-core, so the spliced field also overrides a `"max_tokens": null` before it.
"""

from __future__ import annotations

import json
import math
import posixpath
import re
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote

from .outcomes import Rejection, bad_request, too_large

# vLLM's /v1/completions stops at 16 tokens when `max_tokens` is absent (as OpenAI's legacy API
# does) and knows no `max_completion_tokens`; a chat runs to the end of the context.
LEGACY_DEFAULT_MAX_TOKENS = 16
MAX_SAMPLES = 128  # the most sequences (`n`, `best_of`) one request may ask for
_PARTS_LOOKED_AT = 1000  # of a body with escapes, one by one, before it is encoded whole
# A JSON escape of a UTF-16 surrogate (\ud800-\udfff, hex in either case): only a body holding
# one is walked for a lone one. Other escapes are common: Go's encoder writes <, >, & as
# \u003c..., Python's ensure_ascii every character past ASCII.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
_JSON_SPACE = b" \t\n\r"


class Api:
    """Which of the engine's APIs a path names: where a body's prompt is, and how its answer is
    bounded. (Plain strings: read on every request, where an Enum member costs a lookup.)"""

    CHAT = "chat"  # /v1/chat/completions: `messages` (and `tools`); no bound runs to the end of the context
    COMPLETIONS = "completions"  # /v1/completions: `prompt`; no `max_tokens` is 16, a null runs to the end
    OTHER = "other"  # any other path with a body (/v1/embeddings, /tokenize...): no bound is written in


@dataclass(frozen=True, slots=True)
class CompletionRequest:
    body: dict[str, Any]
    model: str | None
    stream: bool
    # The most tokens the engine generates for each sequence. None: the client set no bound,
    # and the engine would run to the end of the context (the sidecar writes its default in).
    max_tokens: int | None
    samples: int = 1  # sequences sampled for each prompt: `n`, or `best_of` where larger
    api: str = Api.CHAT  # one of Api's
    # The body as it came, kept (not copied) where the sidecar writes a bound into it: a UTF-8
    # body of a chat or completion without one. `rewritten` splices the bound into it.
    raw: bytes | None = field(default=None, repr=False)

    @property
    def needs_bound(self) -> bool:
        """The client set no bound on an API that generates: the sidecar writes its default in."""
        return self.max_tokens is None and self.api != Api.OTHER


class _NotJson(ValueError):
    """NaN, Infinity or -Infinity: Python's json reads them, JSON has no such values."""


class _NotFinite(ValueError):
    """A JSON number past a float's range (1e999): Python reads it as infinity, which the body
    could only be re-encoded as `Infinity`, not JSON."""


def _refuse_constant(name: str) -> None:
    raise _NotJson(name)


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _NotFinite(text if len(text) <= 40 else f"{text[:37]}...")
    return value


_DECODER = json.JSONDecoder(parse_constant=_refuse_constant, parse_float=_finite_float)


def _object(text: str) -> object:
    """`json.loads(text)` for a text that starts with "{": the same value, the same errors."""
    value, end = _DECODER.raw_decode(text)
    if end != len(text) and text[end:].strip(" \t\n\r"):  # JSON's whitespace, and nothing else, may follow
        raise json.JSONDecodeError("Extra data", text, len(text) - len(text[end:].lstrip(" \t\n\r")))
    return value


def check_size(size: int, max_body_bytes: int) -> None:
    if size > max_body_bytes:
        raise too_large(size, max_body_bytes)


def _plain_utf8(raw: bytes) -> bool:
    """An object's first byte "{" and a second byte that is not 0: UTF-8, as json.loads would
    detect (the common case, known without detecting)."""
    return raw[:1] == b"{" and raw[1:2] != b"\x00"


def _decode(raw: bytes) -> object:
    # A plain UTF-8 object (_plain_utf8, written out here: this runs on every request) is read
    # as UTF-8, anything else in the encoding json.loads detects. Strictly, where json.loads
    # passes surrogates: the bytes of one are not Unicode.
    encoding = "utf-8" if raw[:1] == b"{" and raw[1:2] != b"\x00" else json.detect_encoding(raw)
    try:
        text = raw.decode(encoding)
    except UnicodeDecodeError:
        raise bad_request(f"Request body is not valid {encoding.upper().removesuffix('-SIG')}.") from None
    try:
        body = _object(text) if text[:1] == "{" else _DECODER.decode(text)
    except json.JSONDecodeError as error:
        raise bad_request(f"Request body is not valid JSON: {error.msg} at position {error.pos}.") from None
    except _NotJson as error:
        raise bad_request(f"Request body is not valid JSON: {error} is not a JSON value.") from None
    except _NotFinite as error:
        raise bad_request(f"Request body holds a number too large for a float: {error}.") from None
    except ValueError:  # an integer of more digits than Python converts (sys.get_int_max_str_digits)
        raise bad_request("Request body holds a number too long to read.") from None
    except RecursionError:
        raise too_deep() from None
    # An escape ("\\ud800") is the only way to a lone surrogate left after a strict decoding.
    if "\\u" in text and _SURROGATE_ESCAPE.search(text):
        _check_unicode(body)
    return body


def too_deep() -> Rejection:
    """A body nested deeper than Python reads or writes where it is read or written."""
    return bad_request("Request body nests too deeply.")


def _check_unicode(body: object) -> None:
    """Refuse a body holding a lone surrogate (an escape such as "\\ud800" alone): no UTF-8
    encodes it, so the body could be neither re-encoded nor read by the engine."""
    if _holds_surrogate(body):
        where = _surrogate_at(body)
        # (a key may hold the surrogate: the path is written with it escaped, and kept short)
        param = where.encode("utf-8", "backslashreplace").decode()[:80] if where else None
        raise bad_request("Request body is not valid Unicode: a string holds a lone surrogate.", param)


def _holds_surrogate(body: object) -> bool:
    """Whether a string of `body` (a key or a value) holds a lone surrogate. The strings that
    are not ASCII are encoded one by one while the body's parts are few (as in most bodies:
    cheaper than encoding it all), and the body all at once by json's C encoder past that."""
    stack = [body]
    for _ in range(_PARTS_LOOKED_AT):
        if not stack:
            return False
        item = stack.pop()
        if type(item) is str:
            if not item.isascii() and not _encodes(item):
                return True
        elif type(item) is dict:
            stack += item.keys()
            stack += item.values()
        elif type(item) is list:
            stack += item
    try:
        json.dumps(body, ensure_ascii=False).encode()
    except UnicodeEncodeError:
        return True
    except RecursionError:
        raise too_deep() from None
    return False


def _surrogate_at(value: object) -> str | None:
    """Where in `value` the first lone surrogate is, as a path ("messages[0].content")."""
    stack: list[tuple[object, str]] = [(value, "")]
    while stack:
        item, where = stack.pop()
        if isinstance(item, str):
            if not _encodes(item):
                return where or None
        elif isinstance(item, dict):
            for key, child in reversed(item.items()):
                here = f"{where}.{key}" if where else key
                if not _encodes(key):
                    return here
                stack.append((child, here))
        elif isinstance(item, list):
            stack.extend((child, f"{where}[{i}]") for i, child in reversed(list(enumerate(item))))
    return None


def _encodes(text: str) -> bool:
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


def _count(value: object, field: str) -> Any:
    """A field that must be a positive integer when set (null reads as absent)."""
    if value is not None and (type(value) is not int or value < 1):  # (a boolean is an int, not a count)
        raise bad_request(f"'{field}' must be a positive integer.", field)
    return value


def _samples(body: dict[str, Any]) -> int:
    n = _count(body.get("n"), "n") or 1
    best_of = _count(body.get("best_of"), "best_of")
    if max(n, best_of or 0) > MAX_SAMPLES:
        field = "n" if n > MAX_SAMPLES else "best_of"
        raise bad_request(f"'{field}' may be at most {MAX_SAMPLES}.", field)
    if best_of is None:
        return n
    if best_of < n:  # vLLM's own rule
        raise bad_request(f"'best_of' ({best_of}) must be at least 'n' ({n}).", "best_of")
    return best_of


def canonical_path(path: str) -> str:
    """`path` as the engine's HTTP server resolves it: its query aside, percent-escapes decoded,
    repeated slashes merged, `.` and `..` segments resolved, no trailing slash. (Envoy does the
    same with `normalize_path` and `merge_slashes`, as the template sets them; the sidecar does
    not rely on it: a path it reads otherwise than the engine could be costed as another API.)"""
    path = unquote(path.partition("?")[0])
    return posixpath.normpath("/" + path.lstrip("/")) if path else "/"


def api_of(path: str) -> str:
    """The API `path` names, as the engine reads it."""
    if path.endswith("/chat/completions") and "%" not in path and "/." not in path and "//" not in path:
        return Api.CHAT  # (the common case, in one call)
    path = canonical_path(path)
    if path.endswith("/chat/completions"):
        return Api.CHAT
    return Api.COMPLETIONS if path.endswith("/completions") else Api.OTHER


def parse_completion_request(raw: bytes, max_body_bytes: int, path: str = "/v1/chat/completions") -> CompletionRequest:
    check_size(len(raw), max_body_bytes)
    body = _decode(raw)
    if not isinstance(body, dict):
        raise bad_request("Request body must be a JSON object.")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad_request("'model' must be a string.", "model")
    stream = body.get("stream")
    if stream is None:
        stream = False
    elif not isinstance(stream, bool):
        raise bad_request("'stream' must be a boolean.", "stream")
    if "messages" in body and not isinstance(body["messages"], list):
        raise bad_request("'messages' must be an array.", "messages")
    max_tokens = _count(body.get("max_tokens"), "max_tokens")
    api = api_of(path)
    if api == Api.COMPLETIONS:
        if "max_tokens" not in body:
            max_tokens = LEGACY_DEFAULT_MAX_TOKENS
    elif (max_completion_tokens := _count(body.get("max_completion_tokens"), "max_completion_tokens")) is not None:
        max_tokens = max_completion_tokens
    samples = _samples(body) if "n" in body or "best_of" in body else 1
    kept = raw if max_tokens is None and api != Api.OTHER and _plain_utf8(raw) else None
    return CompletionRequest(body, model, stream, max_tokens, samples, api, kept)


def rewritten(request: CompletionRequest, **fields: Any) -> bytes:
    """The body with `fields` set (e.g. a fallback `model`, an engine `priority`, the bound
    the sidecar writes in). Only `max_tokens` on a body kept as it came is spliced in;
    anything else re-encodes the body. Raises a 400 Rejection for a body nested so deep that
    re-encoding meets Python's recursion limit (parsed a few calls nearer the top of the stack,
    it did not)."""
    if request.raw is not None and len(fields) == 1 and "max_tokens" in fields:
        return _with_max_tokens(request.raw, bool(request.body), fields["max_tokens"])
    try:
        return json.dumps({**request.body, **fields}, ensure_ascii=False, allow_nan=False).encode()
    except RecursionError:
        raise too_deep() from None


def _with_max_tokens(raw: bytes, has_fields: bool, max_tokens: int) -> bytes:
    """`raw`, a UTF-8 JSON object, with `"max_tokens": max_tokens` as its last field: written
    before the closing brace (its last byte that is not JSON's whitespace), after a comma
    unless the object is empty. The body is copied once, into the answer."""
    end = len(raw.rstrip(_JSON_SPACE)) - 1
    written = b',"max_tokens":%d' % max_tokens if has_fields else b'"max_tokens":%d' % max_tokens
    view = memoryview(raw)
    return b"".join((view[:end], written, view[end:]))
