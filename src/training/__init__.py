"""Training of the tiny embedded toy-world model (`python examples/train_tiny.py`)."""
