"""Built-in plugins: logits processors, grammar, watermark, speculators, quantizers."""
