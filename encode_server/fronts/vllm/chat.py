"""The media items of an OpenAI chat-completions body, read as vLLM 0.33 reads them.

vLLM's EPD proxy sends the encoder instance the user's `/v1/chat/completions` body (one media item per
request in its fan-out, text parts possibly left in). vLLM's chat parser
(`vllm/renderers/chat_utils/chat_message.py`) takes
- an image part as `{"type": "image_url", "image_url": {"url": ...}}`,
- a video part as `{"type": "video_url", "video_url": {"url": ...}}`,
- an audio part as `{"type": "audio_url", "audio_url": {"url": ...}}` or `{"type": "input_audio",
  "input_audio": {"data": <base64>, "format": "wav"}}` (read as the URL `data:audio/<format>;base64,<data>`),
and, with a part-level `"uuid"`, also without `type` and with the URL given as a bare string or left
out (an item the client says is already cached). Text parts carry nothing for the encoder and are
skipped. Embedding parts (`image_embeds`, `audio_embeds`, ...) are refused here with a 400 naming them:
this producer stores what it encodes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from encode_server.records import EncodeError

#: Part types vLLM's chat parser knows that carry no media.
TEXT_PARTS = ("text", "input_text", "refusal", "thinking")
#: URL part types (the key holding the URL is the type's name) and the modality they carry.
URL_PARTS = {"image_url": "image", "video_url": "video", "audio_url": "audio"}
#: Part types (or keys of untyped parts) that carry media this producer does not store.
OTHER_MEDIA = ("image_pil", "image_embeds", "audio_embeds", "video_embeds", "file", "prompt_embeds")


@dataclass(frozen=True)
class ChatMediaPart:
    """One media item of a chat body: its modality, URL (None: the client names a stored item by its
    uuid alone), the client's `uuid` and where it is (`messages[0].content[1]`) for error messages."""

    modality: str
    url: str | None
    uuid: str | None
    location: str


def _part_url(part: dict[str, Any], key: str, location: str) -> str | None:
    value = part.get(key)
    if isinstance(value, dict):
        value = value.get("url")
    if value is None or isinstance(value, str):
        return value
    raise EncodeError(400, f"{location}.{key}.url must be a string (an http(s) or data: URL), "
                           f"got {type(value).__name__}")


def _input_audio_url(part: dict[str, Any], location: str) -> str | None:
    """vLLM's `parse_input_audio`: `{"data", "format"}` as the URL `data:audio/<format>;base64,<data>`."""
    value = part.get("input_audio")
    if value is None:
        return None
    if not isinstance(value, dict):
        raise EncodeError(400, f"{location}.input_audio must be an object {{\"data\": <base64>, \"format\": "
                               f"\"wav\"}}, got {type(value).__name__}")
    data, audio_format = value.get("data", ""), value.get("format", "")
    if not isinstance(data, str) or not isinstance(audio_format, str):
        raise EncodeError(400, f"{location}.input_audio.data and .format must be strings")
    return f"data:audio/{audio_format};base64,{data}" if data else None


def _media_part(part: dict[str, Any], location: str) -> ChatMediaPart | None:
    kind = part.get("type")
    uuid = part.get("uuid")
    if uuid is not None and not isinstance(uuid, str):
        raise EncodeError(400, f"{location}.uuid must be a string, got {type(uuid).__name__}")
    if kind in TEXT_PARTS:
        return None
    untyped = kind is None or uuid is not None
    for key in (*URL_PARTS, "input_audio"):
        if kind == key or untyped and key in part:
            url = _input_audio_url(part, location) if key == "input_audio" else _part_url(part, key, location)
            if url is None and uuid is None:
                field = "input_audio.data" if key == "input_audio" else f"{key}.url"
                raise EncodeError(400, f"{location}: a {key} part needs {field} (or a uuid naming an item "
                                       f"already stored)")
            return ChatMediaPart(URL_PARTS.get(key, "audio"), url, uuid, location)
    named = kind if kind in OTHER_MEDIA else next((key for key in OTHER_MEDIA if key in part), None)
    if named is not None:
        raise EncodeError(400, f"{location}: {named} parts are not supported by this encoder's vLLM producer, "
                               f"which stores image_url, video_url, audio_url and input_audio items; send "
                               f"{named} items to a vLLM encoder instance")
    raise EncodeError(400, f"{location}: unknown content part type {kind!r}")


def media_parts(payload: Any) -> list[ChatMediaPart]:
    """Every media item of a chat-completions body in order; a 400 naming the first malformed part."""
    if not isinstance(payload, dict):
        raise EncodeError(400, f"the body must be a JSON object, got {type(payload).__name__}")
    messages = payload.get("messages")
    if not isinstance(messages, list) or not messages:
        raise EncodeError(400, "messages: a non-empty list of chat messages is required")
    parts: list[ChatMediaPart] = []
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            raise EncodeError(400, f"messages[{index}] must be an object, got {type(message).__name__}")
        content = message.get("content")
        if content is None or isinstance(content, str):
            continue
        if not isinstance(content, list):
            raise EncodeError(400, f"messages[{index}].content must be a string or a list of parts")
        for position, part in enumerate(content):
            location = f"messages[{index}].content[{position}]"
            if isinstance(part, str):
                continue
            if not isinstance(part, dict):
                raise EncodeError(400, f"{location} must be an object, got {type(part).__name__}")
            media = _media_part(part, location)
            if media is not None:
                parts.append(media)
    return parts
