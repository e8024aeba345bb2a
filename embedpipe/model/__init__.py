"""Everything about the models: families, checkpoints, tokenization, preparing and running.

The rest of embedpipe uses :func:`load_model` and the :class:`~embedpipe.model.base.EmbeddingModel`
interface it returns; the workflow uses :func:`describe`. Importing this package does not
import torch (the modules that need it are imported when a model is loaded).
"""

from embedpipe.model.facts import MemoryEstimate, ModelFacts
from embedpipe.model.layout import TokenLayout
from embedpipe.model.registry import Family, describe, inspect, is_model_name, load_model, register

__all__ = [
    "TokenLayout",
    "Family",
    "MemoryEstimate",
    "ModelFacts",
    "describe",
    "inspect",
    "is_model_name",
    "load_model",
    "register",
]
