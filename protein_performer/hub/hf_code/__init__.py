"""Code that travels with an exported model (``protein_performer.pretrained.export``).

The two modules here are copied verbatim next to ``config.json`` and ``model.safetensors``
and registered through ``auto_map``, so that ``transformers`` can open the directory with
``trust_remote_code=True`` on a machine without protein-performer. They import only torch
and transformers (and each other), and the project itself never imports them.
"""
