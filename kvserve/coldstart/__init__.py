"""Cold start, measured in layers (runtime, weights, warm-up), and what shortens each."""
