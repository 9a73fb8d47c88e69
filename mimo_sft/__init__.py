"""mimo-sft: multimodal SFT of Qwen-VL models on megatron-core's MIMO model.

Importing the package installs one import hook: right before torchvision's first import,
``parallel.cpu_shims.torchvision_compat`` runs (torchvision beside a torch its C++ library was
not built for; docs/install.md). The hook itself imports nothing, so ``validate`` stays fast.
"""

import importlib.abc
import sys

__version__ = "0.1.0"


class _TorchvisionCompat(importlib.abc.MetaPathFinder):
    """Runs ``torchvision_compat`` once, before the first ``import torchvision``; finds nothing itself."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname == "torchvision":
            sys.meta_path.remove(self)
            from mimo_sft.parallel.cpu_shims import torchvision_compat

            torchvision_compat()
        return None


if "torchvision" not in sys.modules and not any(isinstance(f, _TorchvisionCompat) for f in sys.meta_path):
    sys.meta_path.insert(0, _TorchvisionCompat())
