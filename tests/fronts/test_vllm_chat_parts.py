"""The media items of a chat-completions body, read as vLLM 0.33's chat parser reads them
(`fronts.vllm.chat.media_parts`): image, video and audio parts, typed or untyped with a uuid, and the
refusals that name the part."""

from __future__ import annotations

import pytest

from encode_server.fronts.vllm.chat import ChatMediaPart, media_parts
from encode_server.records import EncodeError

pytestmark = pytest.mark.quick


def body(*parts) -> dict:
    return {"messages": [{"role": "system", "content": "be brief"},
                         {"role": "user", "content": [*parts, {"type": "text", "text": "what is this?"}, "plain"]}]}


def test_typed_parts_of_every_modality_in_order():
    parts = media_parts(body(
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
        {"type": "video_url", "video_url": {"url": "https://example.test/a.mp4"}, "uuid": "v-1"},
        {"type": "audio_url", "audio_url": {"url": "data:audio/wav;base64,UklG"}},
        {"type": "input_audio", "input_audio": {"data": "UklG", "format": "flac"}},
    ))
    assert parts == [
        ChatMediaPart("image", "data:image/png;base64,AAAA", None, "messages[1].content[0]"),
        ChatMediaPart("video", "https://example.test/a.mp4", "v-1", "messages[1].content[1]"),
        ChatMediaPart("audio", "data:audio/wav;base64,UklG", None, "messages[1].content[2]"),
        ChatMediaPart("audio", "data:audio/flac;base64,UklG", None, "messages[1].content[3]"),
    ]


def test_untyped_parts_with_a_uuid_as_vllm_takes_them():
    parts = media_parts(body({"uuid": "a", "video_url": "https://example.test/b.mp4"},
                             {"uuid": "b", "audio_url": None}, {"uuid": "c", "input_audio": None},
                             {"uuid": "d", "image_url": {"url": None}}))
    assert [(part.modality, part.url, part.uuid) for part in parts] == [
        ("video", "https://example.test/b.mp4", "a"), ("audio", None, "b"), ("audio", None, "c"), ("image", None, "d")]


@pytest.mark.parametrize(("part", "needle"), [
    ({"type": "video_url", "video_url": {}}, "video_url.url"),
    ({"type": "audio_url", "audio_url": {"url": 3}}, "audio_url.url must be a string"),
    ({"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}, "input_audio.data"),
    ({"type": "input_audio", "input_audio": "UklG"}, "input_audio must be an object"),
    ({"type": "input_audio", "input_audio": {"data": 1, "format": "wav"}}, "must be strings"),
    ({"type": "video_embeds", "video_embeds": "AAAA"}, "video_embeds parts are not supported"),
    ({"type": "video_url", "video_url": {"url": "x"}, "uuid": 7}, "uuid must be a string"),
    ({"type": "hologram"}, "unknown content part type 'hologram'"),
])
def test_malformed_parts_are_400s_naming_them(part, needle):
    with pytest.raises(EncodeError) as raised:
        media_parts(body(part))
    assert raised.value.status == 400 and needle in raised.value.message
    assert "messages[1].content[0]" in raised.value.message
