"""What the Kimi K2.5, GLM-5-Next and MiniMax-M3 VL tests share (and the SGLang harness with them): seeded images
and clips sized to be resized up and down, with odd and even frame counts; per model type the prompt a user turn
holds for one item (`PROMPTS`) and the family's checkpoint builder (`CHECKPOINTS`)."""

from __future__ import annotations

from PIL import Image

from tests.support.checkpoints.glm5_next import glm5_next_checkpoint
from tests.support.checkpoints.kimi_k25 import kimi_k25_checkpoint
from tests.support.checkpoints.minimax_m3_vl import minimax_m3_vl_checkpoint
from tests.support.tiny_parts import clip, random_image

#: Per model type: the prompts a user turn holds for one image and one video (before the processor expands
#: them), the token whose count is an item's rows, and the token the prompt carries per video.
PROMPTS = {
    "kimi_k25": {"image": "describe <|media_start|>image<|media_content|><|media_pad|><|media_end|> please",
                 "video": "describe <|kimi_k25_video_placeholder|> please",
                 "image_token": "<|media_pad|>", "video_token": "<|kimi_k25_video_placeholder|>",
                 "video_row_token": "<|kimi_k25_video_placeholder|>"},
    "glm5_next": {"image": "describe <|begin_of_image|><|image|><|end_of_image|> please",
                  "video": "describe <|begin_of_video|><|video|><|end_of_video|> please",
                  "image_token": "<|image|>", "video_token": "<|video|>",
                  "video_row_token": "<|image|>"},  # GLM fills a video's frames with image tokens
    "minimax_m3_vl": {"image": "describe ]<]image[>[ please", "video": "describe ]<]video[>[ please",
                      "image_token": "]<]image[>[", "video_token": "]<]video[>[",
                      "video_row_token": "]<]video[>["},
}


#: (width, height) of the test images: upscaled, square, wide, tall, downscaled.
IMAGE_SIZES = [(20, 30), (56, 56), (150, 70), (45, 190), (333, 250)]


#: (frames, width, height) of the test clips: one frame, odd and even counts, resized up and down.
CLIP_SIZES = [(1, 56, 56), (3, 100, 60), (5, 50, 150), (8, 200, 140)]


def sample_images() -> list[Image.Image]:
    return [random_image(w, h, 70 + seed) for seed, (w, h) in enumerate(IMAGE_SIZES)]


def sample_clips() -> list[list[Image.Image]]:
    return [clip(n, w, h, 80 + seed) for seed, (n, w, h) in enumerate(CLIP_SIZES)]


CHECKPOINTS = {"kimi_k25": kimi_k25_checkpoint, "glm5_next": glm5_next_checkpoint,
               "minimax_m3_vl": minimax_m3_vl_checkpoint}
