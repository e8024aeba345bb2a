"""The platform that decides a run's numbers, as one short string (``ResolvedRun.platform``).

Why: the same records under the same policy give other vectors on CPUs of other instruction
sets (oneDNN and ATen pick their kernels by ISA; fp32 too, by up to 7.2e-7 pooled), on other
GPU models, and with another torch or oneDNN. The store records it (root attribute
``platform``) and its identity holds it, so resume and ``--reuse`` treat another platform as
another computation unless ``--accept-platform-mix`` (docs/store-format.md, ``platform``).
"""

from __future__ import annotations

import functools
import re

import torch

from embedpipe.runtime.cpu_features import detect, isa_caps


@functools.lru_cache(maxsize=1)
def onednn_version() -> str:
    """oneDNN's version as torch was built with it ('none' without oneDNN, '?' when unsaid)."""
    if not torch.backends.mkldnn.is_available():
        return "none"
    found = re.search(r"(?:oneDNN|MKL-DNN) v(\S+)", torch.__config__.show())
    return found.group(1) if found else "?"


def describe(device: torch.device) -> str:
    """``cpu avx512_bf16 (torch AVX512), torch 2.13.0, onednn 3.12.0`` on the CPU (plus the ISA
    caps in effect); ``cuda NVIDIA H100 sm_90, torch 2.13.0`` on a GPU."""
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return f"cuda {torch.cuda.get_device_name(device)} sm_{major}{minor}, torch {torch.__version__}"
    if device.type != "cpu":
        return f"{device.type}, torch {torch.__version__}"
    features = detect()
    caps = isa_caps()
    return (f"cpu {features.cpu_class} (torch {features.torch_capability or '?'}"
            + (f"; {caps}" if caps else "") + f"), torch {torch.__version__}, onednn {onednn_version()}")
