"""Train the embedded tiny toy-world pipeline on a CPU.

python examples/train_tiny.py --out src/assets/tiny-bouncing-shapes --minutes 60

The shipped model was then fine-tuned for image-to-video (4338 steps in 40 minutes on one thread), and
`ft/transformer/diffusion_pytorch_model.safetensors` replaced the shipped transformer weights:

python examples/train_tiny.py --out ft --init-from src/assets/tiny-bouncing-shapes --minutes 40 --lr 2e-4 \
    --start-image-batches 0.4
"""

from rolldiff.training.__main__ import main

if __name__ == "__main__":
    main()
