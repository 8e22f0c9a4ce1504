"""Subcommands of the `jtree` CLI (see `jtree.cli`)."""
