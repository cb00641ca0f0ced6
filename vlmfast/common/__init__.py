"""Helpers every part of vlmfast shares and none owns: the spec's ``Section`` base (``sections``), writing files
safely (``safe_files``), walking module trees (``module_tree``), TF32 switches (``tf32``) and small tensor / RNG
helpers (``utils``). Nothing here imports the trainer, an engine or a strategy."""
