"""How an item becomes a tower's input, as the model's own `transformers` processors make it: the sampled video
clip and its timestamps, Qwen-style video patching, a family's torchvision-backed processors, and the faster
bit-identical patchify of the PIL image processors.
"""
