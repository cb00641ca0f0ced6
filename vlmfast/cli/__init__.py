"""The ``vlmfast`` command: ``main`` parses and dispatches (lazily, so ``--help`` needs no torch); ``jobs`` builds a
run from a spec and ``--set`` overrides; ``export`` turns a checkpoint into Hugging Face folders."""
