"""Train the embedded tiny toy-world pipeline on a CPU.

python examples/train_tiny.py --out src/assets/tiny-bouncing-shapes --minutes 60
"""

from rolldiff.training.__main__ import main

if __name__ == "__main__":
    main()
