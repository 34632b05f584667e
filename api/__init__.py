"""HTTP API and the `ember` command line."""
