"""The ``colibri`` command and the features behind its subcommands."""
