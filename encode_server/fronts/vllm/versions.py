"""The vLLM versions this producer speaks, told apart by one setting: the consumers' version (`--ec-vllm-version`).

vLLM 0.32 and 0.33 hash items alike (`multimodal/hasher.py` is the same), read chat parts alike and lay out
`ECExampleConnector`'s files alike; where they differ, and so where an item's identifier, its frames or the
connector's answer differ, is written here, each checked against both versions' own code
(`tools/compat/vllm_compat.py` runs under either):

- **images** (`multimodal/media/image.py`, `ImageMediaIO._convert_image_mode`): 0.32 keeps an image whose mode
  is RGB already as it is, a PNG with a `tRNS` chunk included; 0.33 composites any transparency on white first
  (`convert_image_mode` checks transparency before the mode), so such an image hashes with `io_config` there
  and without it in 0.32;
- **videos** (`multimodal/video_decoders/opencv.py`, `get_video_metadata`): a stream whose header gives no frame
  count (streamed WebM/MKV, raw H.264) is counted by demuxing in 0.33; 0.32 keeps the count it read (none) and
  cannot sample it;
- **`ec_transfer_params`** (`ec_connector/utils.py`, `collect_ec_item_metadata`): 0.33 names each item's
  `modality` beside its `item_indices` and `metadata`; 0.32 does not;
- **`ECExampleConnector`** (`example_connector.py`): a 0.32 consumer's lookup creates the item's folder
  (`_generate_filename_debug` with `create_folder=True`), so a miss leaves an empty folder at the consumer's
  identifier; a writer must take such a folder as it finds it (`connectors/example.py` does);
- **`ECCPUConnector`**: the protocol is the same; the compatibility hash names the version string itself.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

#: The minor versions this producer speaks, oldest first; the newest is the default.
MINORS = ("0.32", "0.33")
DEFAULT_VERSION = "0.33.0"
_VERSION = re.compile(r"^(?P<minor>0\.[0-9]+)\.[0-9]+(?:[.+\-][0-9A-Za-z.+\-]*)?$")


@dataclass(frozen=True)
class VllmVersion:
    """The consumers' vLLM version: the string their `vllm.__version__` reads (it enters ECCPUConnector's
    compatibility hash as it is) and the minor whose behaviour the producer follows."""

    text: str = DEFAULT_VERSION

    @property
    def minor(self) -> str:
        match = _VERSION.match(self.text)
        return match.group("minor") if match else ""

    @property
    def composites_rgb_transparency(self) -> bool:
        """0.33: an RGB image with a `tRNS` chunk is composited on white (0.32 keeps it as it is)."""
        return self.minor != "0.32"

    @property
    def counts_frames_by_demuxing(self) -> bool:
        """0.33: a video whose header gives no frame count is counted by demuxing (0.32 cannot sample it)."""
        return self.minor != "0.32"

    @property
    def names_item_modality(self) -> bool:
        """0.33: each `ec_transfer_params` entry names its `modality`."""
        return self.minor != "0.32"


#: The default: consumers of the newest version.
NEWEST = VllmVersion()


def parse_vllm_version(text: str) -> VllmVersion:
    """`--ec-vllm-version`: a release of one of `MINORS` (e.g. 0.32.0, 0.33.1); `ValueError` otherwise."""
    version = VllmVersion(str(text).strip())
    if version.minor not in MINORS:
        raise ValueError(f"--ec-vllm-version {text!r}: this producer speaks vLLM {' and '.join(MINORS)} (give the "
                         f"consumers' version as their vllm.__version__ reads, e.g. {DEFAULT_VERSION})")
    return version
