"""Loading checkpoints: byte ranges of safetensors files, models by Hub id."""
