"""Train the tiny SANA-like toy-world pipeline (`tiny-bouncing-shapes-sana`); see `rolldiff.training.train_sana`.

python examples/train_tiny_sana.py --out stage1 --minutes 95 --threads 2 --first-chunk-weight 2
python examples/train_tiny_sana.py --out stage2 --init-from stage1 --minutes 70 --threads 2 --lr 3e-4 \\
    --first-chunk-weight 2 --first-chunk-batches 0.5
python examples/train_tiny_sana.py --package stage2 --out src/assets/tiny-bouncing-shapes-sana
python examples/train_tiny_sana.py --out ft --init-from src/assets/tiny-bouncing-shapes-sana --minutes 40 \\
    --lr 2e-4 --first-chunk-weight 2 --first-chunk-batches 0.4 --start-image-batches 0.4

(the last run, the image-to-video fine-tune, 5234 steps on one thread; its `ft/transformer` weights replaced the
shipped ones)
"""

from rolldiff.training.train_sana import main

if __name__ == "__main__":
    main()
