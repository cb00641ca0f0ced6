"""Walking a model's module tree: the helpers several strategies and engines share (they never import each other).

Usage::

    find_repeated_blocks(model)          # {'vision_tower.blocks': ModuleList(...), 'lm.layers': ModuleList(...)}
    matches("model.vision_tower.encoder.w", "vision_tower")   # True
"""

from __future__ import annotations

import fnmatch

from torch import nn


def matches(name: str, pattern: str) -> bool:
    """Whether a parameter lies under a module path at any depth, or matches a glob.

    'vision_tower' matches 'vision_tower.blocks.0.w' and Hugging Face's 'model.vision_tower.encoder...';
    'model.vision_tower' and '*.proj.weight' work too.
    """
    return f".{pattern}." in f".{name}." or fnmatch.fnmatchcase(name, pattern)


def find_repeated_blocks(model: nn.Module) -> dict[str, nn.ModuleList]:
    """Outermost ``nn.ModuleList``s holding two or more modules of one class (transformer layers), by path.

    Usage: ``find_repeated_blocks(model)`` -> ``{'vision_tower.blocks': ModuleList(...), ...}``
    """
    found: dict[str, nn.ModuleList] = {}
    for name, module in model.named_modules():
        # Lists inside a found block (MoE experts in a layer) are left alone: nested checkpoints only add recompute.
        if any(name.startswith(f"{outer}.") for outer in found):
            continue
        if isinstance(module, nn.ModuleList) and len(module) >= 2 and len({type(m) for m in module}) == 1:
            found[name] = module
    return found
