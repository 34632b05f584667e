"""Hardware backends, one module per device kind; each is an `ember` entry-point plugin."""
