"""The `shoal` command line: one module per subcommand family, above every component.

Nothing below imports this package; it imports any of them (see docs/architecture.md)."""
