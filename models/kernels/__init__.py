"""The kernels floor: what a family's layers call and the framework runs on the mesh, below every
family and ``models/common.py``. ``attention`` (the dense, blockwise and cuDNN kernels, and the pieces
context parallelism runs itself), ``grouped_matmul`` (the experts' grouped matmuls) and ``fp8`` (FP8
matmuls with their amaxes). A module here imports jax and this floor only; the framework imports
these modules directly."""
