"""The OpenAI chat-completions request a program may send, checked, and the answer it gets.

Pure functions, no I/O: `parse_chat` turns a request body into a `ChatCall` or raises
`ChatError` (an HTTP status, a message that says what to change, the offending field);
`completion` builds the `chat.completion` body. The endpoint (endpoint.py) calls them and
the program team (team.py) generates between the two.

What a request may carry: model (an agent's name), messages (system/developer, user,
assistant, and tool results, as text), max_tokens or max_completion_tokens, stop,
temperature, top_p, n = 1, seed, logprobs, stream = false. Anything else is refused with
400 naming the field: tools and function calling, streaming, response_format, n > 1,
top_logprobs, and image or audio parts. An unknown model gets 404 listing the agents.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

ACCEPTED = frozenset(
    {
        "model", "messages", "max_tokens", "max_completion_tokens", "stop", "temperature",
        "top_p", "n", "seed", "logprobs", "stream",
    }
)  # fmt: skip
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
"""Message roles and the role the chat template gets; `tool` results become user text."""
MAX_MESSAGES = 1024
MAX_STOP = 4  # as OpenAI's API


class ChatError(Exception):
    """A request the endpoint refuses: its HTTP status, what to change, the field."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param

    def body(self) -> dict[str, Any]:
        kind = "not_found_error" if self.status == 404 else "invalid_request_error"
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": None}}


@dataclass
class ChatCall:
    """One checked request: whose call, its messages for the chat template, and what it
    asks of the sampling (None = the agent's own)."""

    agent: str
    messages: list[dict[str, str]]
    max_tokens: int | None = None
    stop: list[str] = field(default_factory=list)
    temperature: float | None = None
    top_p: float | None = None
    logprobs: bool = False


def parse_chat(body: object, agents: Sequence[str]) -> ChatCall:
    """The request `body` (decoded JSON) as a ChatCall; ChatError when it asks for what
    the endpoint cannot give honestly."""
    if not isinstance(body, dict):
        raise ChatError(400, "the request body must be a JSON object")
    unknown = sorted(set(body) - ACCEPTED)
    if unknown:
        raise ChatError(
            400,
            f"{unknown[0]!r} is not supported by this endpoint (it takes "
            f"{', '.join(sorted(ACCEPTED))}): tools, streaming and response formats are "
            "not trained by drmas; leave the field out",
            unknown[0],
        )
    model = body.get("model")
    if model not in agents:
        raise ChatError(
            404, f"model {model!r} is not an agent of this team; use one of {list(agents)}", "model"
        )
    if body.get("stream") not in (None, False):
        raise ChatError(400, "stream=true is not supported: ask for the whole answer", "stream")
    if body.get("n") not in (None, 1):
        raise ChatError(400, "n must be 1: each call is one step of one agent", "n")
    return ChatCall(
        agent=str(model),
        messages=_messages(body.get("messages")),
        max_tokens=_max_tokens(body),
        stop=_stop(body.get("stop")),
        temperature=_number(body, "temperature", 0.0, 2.0),
        top_p=_number(body, "top_p", 0.0, 1.0),
        logprobs=_flag(body, "logprobs"),
    )


def _messages(raw: object) -> list[dict[str, str]]:
    if not isinstance(raw, list) or not raw:
        raise ChatError(400, "messages must be a non-empty list of {role, content}", "messages")
    if len(raw) > MAX_MESSAGES:
        raise ChatError(400, f"at most {MAX_MESSAGES} messages per request", "messages")
    out = []
    for i, m in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise ChatError(400, f"{where} must be an object with role and content", where)
        role = m.get("role")
        if m.get("tool_calls") or m.get("function_call"):
            raise ChatError(400, f"{where}: tool calls are not supported", f"{where}.tool_calls")
        if role == "tool":
            out.append({"role": "user", "content": _text(m.get("content"), where)})
        elif role in ROLES:
            out.append({"role": ROLES[str(role)], "content": _text(m.get("content"), where)})
        else:
            raise ChatError(
                400, f"{where}.role={role!r}: use system, user, assistant or tool", f"{where}.role"
            )
    return out


def _text(content: object, where: str) -> str:
    """A message's content: a string, or a list of text parts (joined)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
        isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
        for p in content
    ):
        return "".join(p["text"] for p in content)
    raise ChatError(
        400, f"{where}.content must be text (a string or text parts)", f"{where}.content"
    )


def _max_tokens(body: dict[str, Any]) -> int | None:
    for key in ("max_completion_tokens", "max_tokens"):
        value = body.get(key)
        if value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ChatError(400, f"{key} must be a whole number >= 1", key)
        return value
    return None


def _stop(raw: object) -> list[str]:
    if raw is None:
        return []
    stops = [raw] if isinstance(raw, str) else raw
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise ChatError(400, "stop must be a non-empty string or a list of them", "stop")
    if len(stops) > MAX_STOP:
        raise ChatError(400, f"at most {MAX_STOP} stop strings", "stop")
    return list(stops)


def _number(body: dict[str, Any], key: str, lo: float, hi: float) -> float | None:
    value = body.get(key)
    if value is None:
        return None
    if not isinstance(value, int | float) or isinstance(value, bool) or not lo <= value <= hi:
        raise ChatError(400, f"{key} must be a number in [{lo:g}, {hi:g}]", key)
    return float(value)


def _flag(body: dict[str, Any], key: str) -> bool:
    value = body.get(key, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise ChatError(400, f"{key} must be true or false", key)
    return value


def plain_chat(messages: Sequence[dict[str, str]]) -> str:
    """The prompt of a model without a chat template (the built-in tiny models): one line
    per message, "System: ...", "User: ...", "Assistant: ...", then "Assistant:". A warm
    start for a program's format writes its transcripts with this too."""
    lines = [f"{m['role'].capitalize()}: {m['content']}" for m in messages]
    return "\n".join([*lines, "Assistant:"])


def cut_at_stop(text: str, stops: Sequence[str]) -> str:
    """The answer's text without a stop string and what follows it (as OpenAI returns it;
    the tokens trained keep it: they are what was sampled)."""
    cuts = [i for i in (text.find(s) for s in stops) if i >= 0]
    return text[: min(cuts)] if cuts else text


def completion(
    agent: str,
    text: str,
    finish_reason: str,
    prompt_tokens: int,
    completion_tokens: int,
    logprobs: list[tuple[str, float]] | None,
) -> dict[str, Any]:
    """The `chat.completion` body of one answer; `logprobs`: (token text, log-prob) per
    sampled token when the request asked for them."""
    choice: dict[str, Any] = {
        "index": 0,
        "message": {"role": "assistant", "content": text, "refusal": None},
        "finish_reason": finish_reason,
        "logprobs": None,
    }
    if logprobs is not None:
        choice["logprobs"] = {
            "content": [
                {"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
                for t, lp in logprobs
            ],
            "refusal": None,
        }
    return {
        "id": f"chatcmpl-{secrets.token_hex(12)}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": agent,
        "choices": [choice],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },
    }


def models(agents: Sequence[str]) -> dict[str, Any]:
    """The `/v1/models` body: one model per agent."""
    return {
        "object": "list",
        "data": [{"id": a, "object": "model", "created": 0, "owned_by": "drmas"} for a in agents],
    }
