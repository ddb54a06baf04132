"""The extension points: hook specifications, the typed registry, entry-point discovery,
and the core's own registrations (``builtins``)."""
