"""Everything a run writes to keep or hand on its state.

``store``: the checkpoint format on disk (atomic step folders, manifests, resume discovery and the one
resume-compatibility check); ``async_save``: writing a checkpoint while training goes on; ``save_dir``: the output
folder's checks (free space, permissions, other runs); ``export``: Hugging Face / PEFT / safetensors folders.
"""
