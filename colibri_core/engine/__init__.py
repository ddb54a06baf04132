"""The runtime: the backend contract, placement, the Python API, generation and sampling."""
