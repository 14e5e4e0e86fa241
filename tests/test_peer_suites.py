"""What diffusers' own model suites assume of a model class, checked on all three of ours offline.

diffusers' suites (tests/models/transformers at 58eb52c, not in the pip package) build the class under a
seed and compare against expectations made with diffusers' class, so a subclass must be the same model
under the same seed: identical weights, and the global generator left where diffusers' class leaves it
(a replaced submodule that re-initialises itself draws extra numbers and shifts every later draw).
"""

from __future__ import annotations

import pytest
import torch
from diffusers import GlmImageTransformer2DModel, SanaVideoTransformer3DModel, WanTransformer3DModel
from glm_tiny_components import DECODER_CONFIG
from test_long_sana_model import TINY_SANA as SANA_CONFIG
from tiny_components import TRANSFORMER_CONFIG

from rolldiff import GlmImageCachedTransformer2DModel, KreaRealtimeTransformer3DModel, LongSanaTransformer3DModel

FAMILIES = {
    "krea": (KreaRealtimeTransformer3DModel, WanTransformer3DModel, TRANSFORMER_CONFIG),
    "long_sana": (LongSanaTransformer3DModel, SanaVideoTransformer3DModel, SANA_CONFIG),
    "glm_image": (GlmImageCachedTransformer2DModel, GlmImageTransformer2DModel, DECODER_CONFIG),
}


def seeded(model_class: type, config: dict, seed: int = 3) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    """The model built under `seed`, the generator state it leaves, and the next number drawn after it."""
    torch.manual_seed(seed)
    model = model_class(**config)
    return model, torch.get_rng_state(), torch.rand(1)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_seeded_model_is_the_diffusers_model_and_draws_the_same_numbers(family):
    ours_class, diffusers_class, config = FAMILIES[family]
    ours, our_state, our_next = seeded(ours_class, config)
    theirs, their_state, their_next = seeded(diffusers_class, config)
    assert torch.equal(our_state, their_state) and torch.equal(our_next, their_next)
    expected = theirs.state_dict()
    received = ours.state_dict()
    assert received.keys() == expected.keys()
    for name, tensor in expected.items():
        torch.testing.assert_close(received[name], tensor, atol=0, rtol=0, msg=name)


@pytest.mark.parametrize("family", FAMILIES)
def test_parameters_are_the_models_own_and_train(family):
    """A taken-over submodule's parameters are registered once, on the CPU, and receive gradients."""
    ours_class, _, config = FAMILIES[family]
    model, _, _ = seeded(ours_class, config)
    parameters = list(model.parameters())
    assert len({id(p) for p in parameters}) == len(parameters)
    assert all(p.device.type == "cpu" and p.requires_grad for p in parameters)
