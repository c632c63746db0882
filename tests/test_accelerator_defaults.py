"""What the `auto` choices resolve to on GPU and TPU, checked on CPU through their platform seams."""

import jax.numpy as jnp
import pytest

from models import TransformerConfig
from models._config import AUTO_UNROLL_MAX_LAYERS, compiling_for, target_platform


@pytest.mark.parametrize("layers", [2, 12, AUTO_UNROLL_MAX_LAYERS, AUTO_UNROLL_MAX_LAYERS + 1, 24, 48])
def test_auto_unroll_is_every_layer_on_gpu_and_tpu_and_the_depth_rule_on_cpu(layers):
    config = TransformerConfig(num_layers=layers)
    for platform in ("cuda", "rocm", "tpu"):
        assert config.layers_per_iteration(platform) == layers
    assert config.layers_per_iteration("cpu") == (layers if layers <= AUTO_UNROLL_MAX_LAYERS else 1)
    assert config.layers_per_iteration() == config.layers_per_iteration("cpu")  # this machine


def test_explicit_scan_unroll_is_kept_on_every_platform():
    for platform in ("cpu", "cuda", "tpu"):
        assert TransformerConfig(num_layers=24, scan_unroll=1).layers_per_iteration(platform) == 1
        assert TransformerConfig(num_layers=24, scan_unroll=4).layers_per_iteration(platform) == 4
        assert TransformerConfig(num_layers=24, scan_unroll=0).layers_per_iteration(platform) == 24


def test_compiling_for_resolves_auto_choices_as_on_that_platform():
    config = TransformerConfig(num_layers=24, dim=768, num_heads=12)
    assert target_platform() == "cpu"
    assert (config.compute_dtype(), config.attention_impl(), config.layers_per_iteration()) == (
        jnp.float32, "xla", 1)
    with compiling_for("cuda"):
        assert target_platform() == "cuda"
        assert (config.compute_dtype(), config.attention_impl(), config.layers_per_iteration()) == (
            jnp.bfloat16, "cudnn", 24)
    with compiling_for("tpu"):
        assert (config.compute_dtype(), config.attention_impl(), config.layers_per_iteration()) == (
            jnp.bfloat16, "xla", 24)
    assert target_platform() == "cpu"
