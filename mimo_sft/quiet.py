"""Keep library chatter off the user's terminal.

megatron-core warns on every process about experimental MIMO APIs, missing Apex/Transformer Engine
and deprecated classes, and transformers shows progress bars while loading weights. None of it is
actionable for a user; it buries the progress line or the one-line error. ``MIMO_SFT_VERBOSE=1``
keeps everything.
"""

from __future__ import annotations

import logging
import os
import warnings


def quiet_libraries() -> None:
    if os.environ.get("MIMO_SFT_VERBOSE"):
        return
    for category in (UserWarning, DeprecationWarning, FutureWarning):
        warnings.filterwarnings("ignore", category=category, module=r"(megatron|torch|transformers)\b.*")
    warnings.filterwarnings("ignore", message=r".*is experimental and still under active development.*")
    logging.getLogger("megatron").setLevel(logging.ERROR)
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        hf_logging.set_verbosity_error()
    except ImportError:  # transformers is a dependency; stay quiet if it is somehow absent
        pass
