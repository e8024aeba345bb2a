"""What runs the model, below ``model/`` and ``embed/``: precision policies (``precision``), the
packed batch layout (``packed``), the layout and attention kernel a run uses (``attention``) and
every CUDA-only call (``cuda``)."""
