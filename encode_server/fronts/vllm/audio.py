"""Audio decoded as vLLM 0.33 decodes it, for the vLLM producer (`--ec-storage`).

vLLM's consumer identifies an audio item by the hash of the waveform its model's data parser hands the
processor, so ours must be that very array, bit for bit:

- `AudioMediaIO.load_bytes` (`vllm/multimodal/media/audio.py`) decodes at the file's own rate; with
  libsndfile (`soundfile`), as vLLM does where torchcodec is not installed: float32 samples, the
  channels averaged (`np.mean` over the channel axis);
- the model's `MultiModalDataParser` resamples to its feature extractor's rate with torchaudio's
  band-limited sinc interpolation (`AudioResampler`, method "torchaudio": `torchaudio.transforms.Resample`,
  Hann window, 6 zero crossings, roll-off 0.99), run as vLLM runs it: one thread, oneDNN off. Which
  thread count the convolution runs with changes the last bits, and the thread count is the process's,
  so the resampling runs in a one-thread helper process of its own (`Resampler`), never in this one;
- the array (`float32`, one dimension) is what is hashed (`identifiers`) and what the encoder
  gets: sent to the native path as a 32-bit float WAV at the model's rate, which it reads back as is.

Formats libsndfile cannot read (vLLM would go on to PyAV) are refused with a 400 naming the ones it reads.
"""

from __future__ import annotations

import io
import math
import multiprocessing
import threading
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

import numpy as np

from encode_server.media.decoding import MediaError


@dataclass(frozen=True)
class VllmAudio:
    """A waveform as vLLM's parser leaves it: mono float32 at the model's rate."""

    samples: np.ndarray
    sample_rate: int

    def wav(self) -> bytes:
        """The samples as a 32-bit float WAV: the native decode reads back exactly these values."""
        import soundfile

        buffer = io.BytesIO()
        soundfile.write(buffer, self.samples, self.sample_rate, format="WAV", subtype="FLOAT")
        return buffer.getvalue()


def decode_vllm_audio_native(data: bytes, max_seconds: float, location: str) -> tuple[np.ndarray, int]:
    """vLLM's `load_audio_soundfile(sr=None)`: float32 samples at the file's rate, channels averaged."""
    import soundfile

    if not data:
        raise MediaError(location, "empty audio data")
    try:
        with soundfile.SoundFile(io.BytesIO(data)) as handle:
            rate = handle.samplerate
            if handle.frames / rate > max_seconds:
                raise MediaError(location, f"audio of {handle.frames / rate:.2f} s is longer than the limit of "
                                           f"{max_seconds:g} s (--max-audio-seconds)")
            samples = handle.read(dtype="float32", always_2d=False).T
    except MediaError:
        raise
    except Exception:
        raise MediaError(location, "not an audio file vLLM's soundfile path reads (WAV, FLAC, OGG or MP3 as "
                                   "libsndfile decodes them)") from None
    if samples.ndim > 1:
        samples = np.mean(samples, axis=tuple(range(samples.ndim - 1)))
    if samples.size == 0:
        raise MediaError(location, "audio has no samples")
    if not np.isfinite(samples).all():
        raise MediaError(location, "audio holds NaN or infinite samples")
    return samples, int(rate)


# --- torchaudio's resampling, as vLLM runs it ------------------------------------------------------------


def _sinc_kernel(orig: int, new: int, gcd: int, width_zeros: int = 6, rolloff: float = 0.99):
    """`torchaudio.functional._get_sinc_resample_kernel` (method "sinc_interp_hann", default dtype)."""
    import torch

    orig, new = orig // gcd, new // gcd
    base = min(orig, new) * rolloff
    width = math.ceil(width_zeros * orig / base)
    idx = torch.arange(-width, width + orig, dtype=torch.float64)[None, None] / orig
    t = torch.arange(0, -new, -1, dtype=None)[:, None, None] / new + idx
    t *= base
    t = t.clamp_(-width_zeros, width_zeros)
    window = torch.cos(t * math.pi / width_zeros / 2) ** 2
    t *= math.pi
    scale = base / orig
    kernels = torch.where(t == 0, torch.tensor(1.0).to(t), t.sin() / t)
    kernels *= window * scale
    return kernels.to(dtype=torch.float32), width


def resample_like_vllm(samples: np.ndarray, orig: int, new: int) -> np.ndarray:
    """`torchaudio.transforms.Resample(orig, new)(samples)` with oneDNN off, as vLLM's
    `resample_audio_torchaudio`; call it where the process runs torch on one thread (`Resampler`)."""
    import torch

    if orig == new:
        return samples
    gcd = math.gcd(orig, new)
    kernel, width = _sinc_kernel(orig, new, gcd)
    waveform = torch.as_tensor(samples, dtype=torch.float32)
    with torch.backends.mkldnn.flags(enabled=False):
        shape = waveform.size()
        waveform = waveform.view(-1, shape[-1])
        count, length = waveform.shape
        step = orig // gcd
        waveform = torch.nn.functional.pad(waveform, (width, width + step))
        out = torch.nn.functional.conv1d(waveform[:, None], kernel, stride=step)
        out = out.transpose(1, 2).reshape(count, -1)
        target = torch.ceil(torch.as_tensor((new // gcd) * length / step)).long()
        out = out[..., :target]
        return out.view(shape[:-1] + out.shape[-1:]).numpy()


def _one_thread() -> None:
    import torch

    torch.set_num_threads(1)


class Resampler:
    """A one-thread helper process that resamples as vLLM does; started on first use, shut at exit."""

    def __init__(self) -> None:
        self._pool: ProcessPoolExecutor | None = None
        self._lock = threading.Lock()

    def resample(self, samples: np.ndarray, orig: int, new: int) -> np.ndarray:
        if math.isclose(float(orig), float(new), rel_tol=0.0, abs_tol=1e-6):
            return samples
        with self._lock:
            if self._pool is None:
                self._pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"),
                                                 initializer=_one_thread)
            pool = self._pool
        return pool.submit(resample_like_vllm, samples, int(round(orig)), int(round(new))).result()

    def close(self) -> None:
        with self._lock:
            if self._pool is not None:
                self._pool.shutdown(wait=False, cancel_futures=True)
                self._pool = None


def decode_vllm_audio(data: bytes, target_rate: int, max_seconds: float, location: str,
                      resampler: Resampler) -> VllmAudio:
    """An audio file as the waveform a vLLM consumer's parser gives its processor (and hashes)."""
    samples, rate = decode_vllm_audio_native(data, max_seconds, location)
    resampled = resampler.resample(samples, rate, target_rate)
    return VllmAudio(np.ascontiguousarray(resampled), int(target_rate))
