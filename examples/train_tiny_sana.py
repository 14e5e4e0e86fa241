"""Train the tiny SANA-like toy-world pipeline (`tiny-bouncing-shapes-sana`); see `rolldiff.training.train_sana`.

nice -n 10 python examples/train_tiny_sana.py --out src/assets/tiny-bouncing-shapes-sana --minutes 60
"""

from rolldiff.training.train_sana import main

if __name__ == "__main__":
    main()
