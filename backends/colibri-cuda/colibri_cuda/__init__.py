"""colibri-cuda: the CUDA compute backend (``--backend cuda``), on CuPy.

The plugin module (``colibri_cuda.plugin``) imports neither CuPy nor numpy; the backend
(``colibri_cuda.backend``) loads when a model runs on it.
"""

__version__ = "0.1.0"
