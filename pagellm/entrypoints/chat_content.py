"""A chat message's content as chat templates read it: a string. A list of OpenAI content
parts becomes its text parts joined by newlines, as vLLM's "string" content format joins
them; a part of another type (image_url, input_audio, file) is an error naming it, since the
models pagellm serves take text only. Used by the server and by ``LLM.chat``."""
from __future__ import annotations

from typing import Any

PART_SEPARATOR = "\n"


def flatten_content(content: Any, where: str) -> Any:
    """``content`` with a list of parts joined into one string; anything else as it is.
    ``where`` names the content in errors (e.g. "messages[0].content")."""
    if not isinstance(content, list):
        return content
    texts = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text":
            got = f"type {kind!r}" if kind is not None else f"a {type(part).__name__}"
            raise ValueError(f"{where}[{i}] is {got}: the model takes text only, parts of the "
                             "form {'type': 'text', 'text': ...}")
        if not isinstance(part.get("text"), str):
            raise ValueError(f"{where}[{i}].text must be a string")
        if set(part) != {"type", "text"}:
            raise ValueError(f"{where}[{i}] has unknown fields: "
                             f"{', '.join(sorted(set(part) - {'type', 'text'}))}")
        texts.append(part["text"])
    return PART_SEPARATOR.join(texts)
