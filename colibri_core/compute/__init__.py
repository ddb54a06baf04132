"""The compute seam: the backend contract (``backend``), the host reference of its ops
(``reference``) and the built-in CPU backend (``cpu``). It sits under ``nn`` (which
builds layers from the contract's ops) and imports nothing above it; third-party
backends implement ``colibri_core.compute.backend.Backend``."""
