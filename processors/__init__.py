"""Media items to an encoder's inputs: the processor half of every model family, beside the server.

A `Processor` (`base.py`) turns a batch's decoded items (PIL images, waveforms, `VideoClip`s) into the tensors
its tower takes with one call, says cheaply how many rows each item becomes (`ItemLayout`, from the model's own
sizing rule) and fuses per-item results into one `PreparedBatch`; it holds settings and `transformers`
processors, never a model, so it pickles as it is into the server's preprocessing workers. The shared rules are
here: the Qwen/GLM patch grid and its image sizing (`grid.py`), video clips and their timestamps
(`video_clip.py`), Qwen-style video patching without torchvision (`video_patches.py`), a family's own
torchvision-backed processors (`torchvision_processors.py`), the bit-identical faster patchify
(`fast_patches.py`), the Omni thinkers' log-mel features (`omni_audio.py`), a vision-language model's image
half (`vision_part.py`), per-item inputs joined into one batch (`joined_inputs.py`) and items in a chat request
(`chat_request.py`). `families/` holds the processors of families with rules of their own.

This package imports nothing of `encode_server` (a test checks): the server's model layer imports it, never the
reverse.
"""

from processors.base import CheckpointError, ItemError, ItemLayout, PreparedBatch, Processor

__all__ = ["CheckpointError", "ItemError", "ItemLayout", "PreparedBatch", "Processor"]
