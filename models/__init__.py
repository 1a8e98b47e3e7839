"""The meshtrain model zoo: model families that name logical axes only (``models/api.py``).

Importing the package registers the built-in families.
"""

from models import deepseek, llama, moe  # noqa: F401  (register the families)
