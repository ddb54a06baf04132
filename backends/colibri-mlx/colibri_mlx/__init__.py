"""colibri-mlx: the MLX compute backend (``--backend mlx``).

The plugin module (``colibri_mlx.plugin``) imports neither mlx nor numpy; the backend
(``colibri_mlx.backend``) loads when a model runs on it.
"""

__version__ = "0.1.0"
