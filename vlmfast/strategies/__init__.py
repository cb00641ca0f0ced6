"""One file per strategy: its spec section, a plain function usable alone, and a thin class the loop composes.

The protocol is in :mod:`vlmfast.strategies.base`; which strategies a spec turns on, and in which order, is
:func:`vlmfast.strategies.registry.build_strategies`. Standalone functions are re-exported by :mod:`vlmfast.hooks`.
"""
