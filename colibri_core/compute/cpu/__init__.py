"""The built-in CPU backend: numpy float32 with BLAS, plus colibri's compiled kernels
(``_kernels.c``) for packed weights. Only the registry entry in
``colibri_core.plugins.builtins`` names it; the rest of the core reaches it through the
registry."""
