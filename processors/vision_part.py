"""What the processors of a `transformers` vision-language model's image half share: items checked as images, a
sample image, and the folder's processor settings as the full processor reads them (`processor_config.json`,
its `__init__` defaults, read from source where the module cannot be imported here).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from PIL import Image

from processors.base import CheckpointError, ItemError, Processor


class ImageProcessorBase(Processor):
    """A processor of images (a subclass adds modalities where its model takes more)."""

    modalities: tuple[str, ...] = ("image",)

    def sample_item(self) -> tuple[str, Any]:
        return "image", Image.new("RGB", (64, 48), (128, 128, 128))


def processor_settings(folder: Path) -> dict[str, Any]:
    """The folder's `processor_config.json` (the full processor's own settings), or `{}` without one."""
    path = folder / "processor_config.json"
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except ValueError as exc:
        raise CheckpointError(f"{path} is not valid JSON: {exc}") from None


def init_default(function: Any, name: str) -> Any:
    """A keyword's default in a processor's `__init__`: what the full processor uses when the folder is silent."""
    import inspect

    return inspect.signature(function).parameters[name].default


def source_init_defaults(module_name: str, class_name: str) -> dict[str, Any]:
    """A class's `__init__` keyword defaults read from its module's source, for modules that cannot be imported here
    (e.g. they import torchvision at the top) although the defaults are plain literals."""
    import ast
    import importlib.util

    spec = importlib.util.find_spec(module_name)
    if spec is None or spec.origin is None:
        raise CheckpointError(f"{module_name} is not part of this transformers installation")
    tree = ast.parse(Path(spec.origin).read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == class_name:
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == "__init__":
                    arguments = item.args.args[len(item.args.args) - len(item.args.defaults):]
                    return {a.arg: ast.literal_eval(d) for a, d in zip(arguments, item.args.defaults)}
    raise CheckpointError(f"{module_name} has no {class_name}.__init__")


def as_images(items: Sequence[Any]) -> list[Image.Image]:
    """The items as RGB PIL images, or an `ItemError` naming the first one that is not an image."""
    for index, item in enumerate(items):
        if not isinstance(item, Image.Image):
            raise ItemError(f"item {index}: expected an image, got {type(item).__name__}")
    return list(items)
