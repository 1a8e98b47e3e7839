"""The weights' files, in and out of meshtrain, each read shard by shard onto a mesh:

- ``hf.py``            Hugging Face ``config.json`` + safetensors, through a family's HF adapter;
- ``export_format.py`` the params-only export (``params/`` + ``meshtrain.json``): what
                       ``python -m meshtrain.export`` writes and ``checkpoint.init_from`` reads;
- ``peft.py``          a LoRA run's adapters as a PEFT adapter directory, and back;
- ``loading.py``       any of these, or a run's checkpoint, loaded onto a mesh for the tools.

A run's own checkpoints (the whole train state) are ``meshtrain/checkpoint.py``.
"""
