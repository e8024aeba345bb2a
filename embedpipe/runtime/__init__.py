"""What runs the model, below ``model/`` and ``extraction/``: precision policies (``precision``), the
packed batch layout (``packed``), the layout and attention kernel a run uses (``attention``) and
every CUDA-only call (``cuda``)."""

# the int8 policies register themselves (runtime/precision.py, add_policies); importing them
# here, where every import of a runtime module passes first, keeps precision.py free of a
# circular import of the module that subclasses it
from embedpipe.runtime import int8_policy  # noqa: F401
