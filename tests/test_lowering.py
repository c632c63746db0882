"""Compile checks for the backends users train on: the CLI's inner step and one sync program lowered
for CUDA and for TPU on this CPU machine (`.lower(lowering_platforms=...)`), with the `auto` choices
resolved as on that backend (`models._config.compiling_for`). Lowering compiles nothing, so these
run in seconds; they check what the programs hold, not what a backend's compiler makes of them."""

import re

import equinox as eqx
import jax
import numpy as np
import pytest

from eqx_diloco.lm._core import make_diloco
from eqx_diloco.lm.config import Config, DataConfig, MeshConfig
from models import Transformer, TransformerConfig
from models._config import compiling_for

PLATFORMS = ("cuda", "tpu")
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "collective_permute",
               "collective_broadcast")


@pytest.fixture(autouse=True)
def cudnn_without_a_gpu(monkeypatch):
    """JAX asks the cuDNN library for its version when it traces cuDNN attention, and refuses without a GPU
    plugin; the lowered program does not depend on it (any cuDNN 9 accepts this attention)."""
    from jax._src.cudnn import fused_attention_stablehlo

    monkeypatch.setattr(fused_attention_stablehlo, "check_cudnn_version", lambda: 91000)


def lowered(config: Config, platform: str):
    """(inner step, blocking sync of fragment 0, the compute mesh), lowered for `platform`, as text."""
    # JAX's own XLA attention (TPU's kernel here) promotes bfloat16 with float32 inside
    # `jax.nn.dot_product_attention`, which the suite's strict promotion refuses.
    promotion = "standard" if platform == "tpu" else "strict"
    with compiling_for(platform), jax.numpy_dtype_promotion(promotion):
        core = make_diloco(config, eqx.filter_eval_shape(Transformer, config.model, key=jax.random.key(0)))
        state = core.abstract_state
        t = config.train
        batch = jax.ShapeDtypeStruct((config.diloco.num_replicas, t.batch_size, t.seq_len + 1), "int32")
        step = core.inner_step.trace(state, batch).lower(lowering_platforms=(platform,)).as_text()
        sync = core.outer._fns["sync"][0].trace(state).lower(lowering_platforms=(platform,)).as_text()
    return step, sync, core.mesh, len(jax.tree.leaves(state))


def main_arguments(text: str) -> list[str]:
    """The attributes of each argument of the program's entry point."""
    signature = re.search(r"func\.func public @main\((.*?)\) -> ", text, re.S).group(1)
    return re.split(r", (?=%arg\d+:)", signature)


def dots(text: str) -> list[str]:
    return re.findall(r"stablehlo\.dot_general [^\n]*", text)


def runs_in_bfloat16(dot: str) -> bool:
    """Both operands bfloat16, or an algorithm that multiplies them in bfloat16 (XLA attention's backward)."""
    operands = re.search(r": \((tensor<[^>]*>), (tensor<[^>]*>)\) ->", dot).groups()
    if all(o.endswith("xbf16>") for o in operands):
        return True
    return "lhs_precision_type = bf16, rhs_precision_type = bf16" in dot


def collectives(text: str) -> list[tuple[list[list[int]], int]]:
    """Every collective's device groups (positions in the mesh's device order) and how many values it
    carries per device."""
    found = []
    for op in re.finditer(rf"stablehlo\.({'|'.join(COLLECTIVES)})\b", text):
        head = text[op.start():op.start() + 2000]
        groups = re.search(r"(?:replica_groups|source_target_pairs) = dense<(\[.*?\])>", head)
        assert groups is not None, f"a collective without groups: {head[:200]}"
        operand = re.search(r"\) : \(tensor<([^>]*)>", head).group(1)  # the first operand's type
        size = int(np.prod([int(n) for n in operand.split("x")[:-1]], dtype=np.int64))
        found.append((eval(groups.group(1)), size))  # a nested list of ints
    return found


def assert_exchange_over_diloco_only(found: list[tuple[list[list[int]], int]], mesh) -> None:
    """Every collective that carries parameters' values runs over `diloco` alone (its groups' devices
    differ in their `diloco` coordinate only): the exchange crosses islands, never the devices
    inside one. Inside an island only one-value flags travel (its shards agreeing on finiteness)."""
    shape = mesh.devices.shape
    exchange = [(groups, size) for groups, size in found if size > 1]
    assert exchange, "the sync exchanges nothing"
    for groups, size in found:
        for group in groups:
            coordinates = np.array([np.unravel_index(i, shape) for i in group])
            across_islands = (coordinates[:, 1:] == coordinates[0, 1:]).all() and \
                len(set(coordinates[:, 0])) == len(group)
            within_island = (coordinates[:, 0] == coordinates[0, 0]).all()
            assert across_islands or (within_island and size == 1), (groups, size, shape)


def no_host_callback(text: str) -> bool:
    targets = re.findall(r"(?:custom_call @|call_target_name = \")([\w$.]+)", text)
    return not any("callback" in t.lower() for t in targets)


@pytest.mark.parametrize("platform", PLATFORMS)
def test_the_cli_defaults_lower_for_the_accelerator_as_users_run_them(platform):
    config = Config(data=DataConfig(source="synthetic"))
    step, sync, mesh, leaves = lowered(config, platform)
    found = dots(step)
    assert found and all(runs_in_bfloat16(d) for d in found), [d[-200:] for d in found if not runs_in_bfloat16(d)]
    cudnn = set(re.findall(r"custom_call @(__cudnn\$\w+)", step))
    if platform == "cuda":
        assert cudnn == {"__cudnn$fmhaSoftmax", "__cudnn$fmhaSoftmaxBackward"}
    else:
        assert not cudnn
    assert "stablehlo.while" not in step  # the stack unrolled
    arguments = main_arguments(step)
    state_arguments, batch = arguments[:leaves], arguments[leaves:]
    assert len(batch) == 1 and "buffer_donor" not in batch[0]
    assert all("jax.buffer_donor = true" in a or "tf.aliasing_output" in a for a in state_arguments)
    assert no_host_callback(step) and no_host_callback(sync)
    assert_exchange_over_diloco_only(collectives(sync), mesh)
    assert "stablehlo.while" not in sync


@pytest.mark.parametrize("platform", PLATFORMS)
def test_a_deep_stack_is_unrolled_on_the_accelerator(platform):
    """24 layers: rolled on CPU (`auto`), every layer unrolled when lowered for GPU or TPU."""
    model = TransformerConfig(num_layers=24, dim=64, num_heads=2, mlp_ratio=2)
    step, *_ = lowered(Config(data=DataConfig(source="synthetic"), model=model), platform)
    assert "stablehlo.while" not in step
    with compiling_for("cpu"):
        assert model.layers_per_iteration() == 1


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("layout", [dict(data=2), dict(fsdp=2), dict(data=2, fsdp=2)])
def test_the_sync_exchanges_over_diloco_only_on_islands_of_several_devices(platform, layout):
    config = Config(data=DataConfig(source="synthetic"), mesh=MeshConfig(**layout),
                    model=TransformerConfig(num_layers=2, dim=64, num_heads=2, mlp_ratio=2))
    _, sync, mesh, _ = lowered(config, platform)
    assert mesh.devices.shape == (2, layout.get("data", 1), layout.get("fsdp", 1), 1)
    assert_exchange_over_diloco_only(collectives(sync), mesh)
    assert no_host_callback(sync)
