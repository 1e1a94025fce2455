"""Data parallelism: the prefix-aware router over kvserve replicas (``kvserve router``) and
``kvserve serve --data-parallel-size N``. ``policy`` and ``keys`` are torch-free."""
