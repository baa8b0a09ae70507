"""Hide torchvision from this interpreter, as on a machine without it: put this folder first on PYTHONPATH.

Every import finder is wrapped so that `torchvision` and its submodules are never found; transformers
then reports it unavailable and resolves its PIL processors, the fallback the server must keep serving.
"""

import sys


class _WithoutTorchvision:
    def __init__(self, finder):
        self._finder = finder

    def find_spec(self, name, path=None, target=None):
        if name == "torchvision" or name.startswith("torchvision."):
            return None
        find_spec = getattr(self._finder, "find_spec", None)
        return find_spec(name, path, target) if find_spec is not None else None

    def __getattr__(self, attribute):
        return getattr(self._finder, attribute)


sys.meta_path[:] = [_WithoutTorchvision(finder) for finder in sys.meta_path]
