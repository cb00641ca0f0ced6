"""Per-image feature caching for frozen vision towers: content keys, the on-disk store, the cached call.

The strategy (`vision_cache` in the spec) lives in :mod:`vlmfast.strategies.vision_cache`; this package holds the
parts it is built from, usable alone.

Usage::

    from vlmfast.features import FeatureStore, image_key
    store = FeatureStore("/tmp/features/ns", max_bytes=2**30)
    store.put(image_key(pixels[0]), features[0]); store.get_many([image_key(pixels[0])])
"""

from vlmfast.features.keys import KEYS_FIELD, KeyedCollate, check_deterministic, hash_bytes, image_key
from vlmfast.features.store import FeatureStore

__all__ = ["KEYS_FIELD", "FeatureStore", "KeyedCollate", "check_deterministic", "hash_bytes", "image_key"]
