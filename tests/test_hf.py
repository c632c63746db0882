"""Hugging Face checkpoints in and out (`eqx_diloco.lm.hf`): logits equal `transformers`' on tiny random
Llama, Mistral and Qwen2 models it saves here, import then export gives back the same tensors, and every
folder, config field or tensor that cannot be mapped is refused in one line naming it.

`torch` and `transformers` are imported once, by the module-scoped `hf` fixture (about 7 s): only the tests
that need them pay for it, and the fast tier keeps one logits comparison each way."""

import dataclasses
import json
import types
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from eqx_diloco._errors import ConfigError
from eqx_diloco.lm.config import Config, DataConfig, ModelFlags, validate
from eqx_diloco.lm.hf import hf_tensors, load_hf_model, write_hf
from models import Transformer, TransformerConfig

VOCAB = 64


@pytest.fixture(scope="module")
def hf():
    """torch and transformers, imported once for the module."""
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    return types.SimpleNamespace(torch=torch, transformers=transformers)


def save_tiny(hf, folder: Path, architecture: str = "llama", *, tie: bool = False, kv_heads: int = 2,
              shard: bool = False, seed: int = 0):
    """A random `transformers` model of `architecture` (2 layers, width 32, 4 heads), saved to `folder` as
    safetensors (shards of about 20 kB with `shard`). Every weight is drawn from N(0, 0.2) so that norm gains
    and biases (ones and zeros when initialised) are checked too. Returns the torch model."""
    t = hf.transformers
    classes = {"llama": (t.LlamaConfig, t.LlamaForCausalLM, {}),
               "mistral": (t.MistralConfig, t.MistralForCausalLM, {"sliding_window": None}),
               "qwen2": (t.Qwen2Config, t.Qwen2ForCausalLM, {})}
    config_cls, model_cls, extra = classes[architecture]
    config = config_cls(vocab_size=VOCAB, hidden_size=32, intermediate_size=72, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=kv_heads, rms_norm_eps=1e-5, rope_theta=500.0,
                        tie_word_embeddings=tie, **extra)
    hf.torch.manual_seed(seed)
    model = model_cls(config).eval()
    with hf.torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    model.save_pretrained(folder, max_shard_size="20KB" if shard else "50GB")
    return model


def torch_logits(hf, model, tokens: np.ndarray) -> np.ndarray:
    with hf.torch.no_grad():
        return model(hf.torch.tensor(tokens[None], dtype=hf.torch.long)).logits[0].float().numpy()


def random_tokens(seed: int = 0, n: int = 24) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, VOCAB, n)


@pytest.fixture(scope="module")
def llama_folder(hf, tmp_path_factory):
    folder = tmp_path_factory.mktemp("hf") / "llama"
    return folder, save_tiny(hf, folder)


def test_llama_folder_loads_with_transformers_logits(hf, llama_folder):
    folder, reference = llama_folder
    config, model = load_hf_model(folder)
    assert (config.mlp, config.kind, config.num_kv_heads, config.ffn_dim) == ("swiglu", "dense", 2, 72)
    assert (config.norm_eps, config.rope_base, config.tie_embeddings) == (1e-5, 500.0, False)
    assert all(x.dtype == jnp.float32 and x.shape[0] == 2 for x in jax.tree.leaves(model.blocks))
    tokens = random_tokens()
    ours = np.asarray(model(jnp.asarray(tokens, jnp.int32)))
    np.testing.assert_allclose(ours, torch_logits(hf, reference, tokens), atol=1e-4, rtol=0)


@pytest.mark.parametrize("architecture,tie,kv_heads,shard", [
    pytest.param("mistral", False, 2, False, marks=pytest.mark.slow),
    pytest.param("qwen2", False, 2, False, marks=pytest.mark.slow),  # q/k/v biases
    pytest.param("llama", True, 1, False, marks=pytest.mark.slow),  # tied head, one key/value head
    pytest.param("qwen2", True, 4, True, marks=pytest.mark.slow),  # shards with an index, no GQA
])
def test_other_layouts_match_transformers_logits(hf, tmp_path, architecture, tie, kv_heads, shard):
    reference = save_tiny(hf, tmp_path / "m", architecture, tie=tie, kv_heads=kv_heads, shard=shard, seed=3)
    if shard:
        assert (tmp_path / "m" / "model.safetensors.index.json").is_file()
        assert len(list((tmp_path / "m").glob("*.safetensors"))) > 2
    config, model = load_hf_model(tmp_path / "m")
    assert config.qkv_bias == (architecture == "qwen2") and config.tie_embeddings == tie
    tokens = random_tokens(1)
    np.testing.assert_allclose(np.asarray(model(jnp.asarray(tokens, jnp.int32))), torch_logits(hf, reference, tokens),
                               atol=1e-4, rtol=0)


def _hf_folder_tensors(folder: Path) -> dict[str, np.ndarray]:
    out = {}
    for path in sorted(folder.glob("*.safetensors")):
        out.update(load_file(path))
    return out


def test_import_then_export_gives_back_the_same_tensors(llama_folder, tmp_path):
    folder, _ = llama_folder
    _, model = load_hf_model(folder)
    write_hf(model, tmp_path / "out")
    before, after = _hf_folder_tensors(folder), _hf_folder_tensors(tmp_path / "out")
    assert sorted(before) == sorted(after)
    for name, value in before.items():
        assert after[name].dtype == value.dtype and after[name].shape == value.shape, name
        np.testing.assert_array_equal(after[name].view(np.uint32), value.view(np.uint32), err_msg=name)


@pytest.mark.slow
@pytest.mark.parametrize("architecture", ["qwen2", "mistral"])
def test_import_then_export_round_trip_other_layouts(hf, tmp_path, architecture):
    save_tiny(hf, tmp_path / "m", architecture, tie=architecture == "qwen2", shard=True)
    _, model = load_hf_model(tmp_path / "m")
    write_hf(model, tmp_path / "out")
    before, after = _hf_folder_tensors(tmp_path / "m"), _hf_folder_tensors(tmp_path / "out")
    assert sorted(before) == sorted(after)
    for name, value in before.items():
        np.testing.assert_array_equal(after[name].view(np.uint32), value.view(np.uint32), err_msg=name)
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert written["architectures"] == [{"qwen2": "Qwen2ForCausalLM", "mistral": "LlamaForCausalLM"}[architecture]]


def _swiglu_model(**overrides) -> Transformer:
    config = TransformerConfig(vocab_size=VOCAB, num_layers=3, dim=32, num_heads=4, num_kv_heads=2, mlp="swiglu",
                               ffn_dim=48, norm_eps=1e-5, rope_base=1000.0, **overrides)
    model = Transformer(config, key=jax.random.key(4))
    # Norm gains away from 1 (and biases away from 0), so a misplaced one shows in the logits.
    return jax.tree.map(lambda x: x + 0.3 * jax.random.normal(jax.random.key(x.size), x.shape), model)


@pytest.mark.parametrize("overrides", [{}, pytest.param({"tie_embeddings": True, "qkv_bias": True},
                                                         marks=pytest.mark.slow)])
def test_exported_folder_loads_in_transformers_with_the_same_logits(hf, tmp_path, overrides):
    model = _swiglu_model(**overrides)
    files = write_hf(model, tmp_path / "out", max_positions=64)
    assert files == ["config.json", "model.safetensors"]
    loaded = hf.transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=hf.torch.float32).eval()
    expected = "Qwen2ForCausalLM" if overrides.get("qkv_bias") else "LlamaForCausalLM"
    assert type(loaded).__name__ == expected
    tokens = random_tokens(2, 40)
    np.testing.assert_allclose(torch_logits(hf, loaded, tokens), np.asarray(model(jnp.asarray(tokens, jnp.int32))),
                               atol=1e-4, rtol=0)


# -- refusals: one line naming what cannot be mapped (no torch needed) ---------------------------------------


def _write_folder(folder: Path, model: Transformer, **config_changes) -> Path:
    """`model` as an HF folder with `config_changes` applied to its config.json (None deletes a key)."""
    write_hf(model, folder)
    path = folder / "config.json"
    raw = json.loads(path.read_text())
    raw.update(config_changes)
    path.write_text(json.dumps({k: v for k, v in raw.items() if v is not None}))
    return folder


def test_bfloat16_shards_load_as_float32(tmp_path):
    """Published checkpoints are mostly bfloat16: read through ml_dtypes, widened exactly to float32."""
    import ml_dtypes

    folder = _write_folder(tmp_path / "m", _swiglu_model())
    tensors = {k: v.astype(ml_dtypes.bfloat16) for k, v in load_file(folder / "model.safetensors").items()}
    save_file(tensors, str(folder / "model.safetensors"))
    _, model = load_hf_model(folder)
    assert {x.dtype for x in jax.tree.leaves(model)} == {jnp.dtype(jnp.float32)}
    for name, value in hf_tensors(model).items():
        np.testing.assert_array_equal(value, tensors[name].astype(np.float32), err_msg=name)


@pytest.mark.parametrize("config_changes,message", [
    ({"architectures": ["GPT2LMHeadModel"]}, "architecture ['GPT2LMHeadModel'] is not supported"),
    ({"architectures": None, "model_type": "gemma"}, "architecture gemma is not supported"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "rope_scaling"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}}, "rope_parameters rope_type 'yarn'"),
    ({"head_dim": 16}, "head_dim 16 cannot be mapped"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ({"attention_bias": True}, "attention_bias true"),
    ({"mlp_bias": True}, "mlp_bias true"),
    ({"num_key_value_heads": 3}, "num_key_value_heads 3 must divide num_attention_heads 4"),
    ({"architectures": ["MistralForCausalLM"], "sliding_window": 4096}, "sliding_window 4096"),
    ({"quantization_config": {"quant_method": "gptq"}}, "quantization_config"),
    ({"vocab_size": "64"}, "vocab_size must be an int >= 1"),
    ({"rms_norm_eps": -1}, "rms_norm_eps must be a number > 0"),
])
def test_unmappable_config_is_refused_naming_the_field(tmp_path, config_changes, message):
    folder = _write_folder(tmp_path / "m", _swiglu_model(), **config_changes)
    with pytest.raises(ConfigError, match="config.json: ") as error:
        load_hf_model(folder)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_unmappable_tensors_and_files_are_refused_naming_them(tmp_path):
    model = _swiglu_model()
    folder = _write_folder(tmp_path / "m", model)
    tensors = load_file(folder / "model.safetensors")
    cases = [
        ({**tensors, "model.layers.0.self_attn.rotary_emb.inv_freq": np.ones(4, np.float32)}, None),  # ignored
        ({**tensors, "model.layers.0.mlp.extra.weight": np.ones(4, np.float32)},
         "tensor model.layers.0.mlp.extra.weight cannot be mapped"),
        ({k: v for k, v in tensors.items() if k != "model.layers.2.mlp.up_proj.weight"},
         "tensor model.layers.2.mlp.up_proj.weight is missing"),
        ({**tensors, "model.layers.1.self_attn.k_proj.weight": np.ones((32, 32), np.float32)},
         "tensor model.layers.1.self_attn.k_proj.weight has shape (32, 32)"),
    ]
    for changed, message in cases:
        save_file(changed, str(folder / "model.safetensors"))
        if message is None:
            load_hf_model(folder)
            continue
        with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
            load_hf_model(folder)
    (folder / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00not json")
    with pytest.raises(ConfigError, match="cannot be read as safetensors"):
        load_hf_model(folder)
    (folder / "model.safetensors").unlink()
    (folder / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(ConfigError, match="holds neither model.safetensors nor .*found pytorch_model.bin"):
        load_hf_model(folder)
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "gone.safetensors"}}))
    with pytest.raises(ConfigError, match="names the shard gone.safetensors"):
        load_hf_model(folder)
    (folder / "config.json").unlink()
    with pytest.raises(ConfigError, match="holds no config.json"):
        load_hf_model(folder)
    with pytest.raises(ConfigError, match="is not a folder"):
        load_hf_model(folder / "nothing")


@pytest.mark.parametrize("overrides,message", [
    ({"mlp": "gelu"}, "--format hf: --model.mlp gelu has no Llama equivalent"),
    ({"mlp": "gelu", "kind": "moe"}, "--format hf: --model.kind moe has no Llama equivalent"),
])
def test_export_refuses_layouts_without_a_llama_equivalent(tmp_path, overrides, message):
    config = TransformerConfig(vocab_size=VOCAB, num_layers=2, dim=16, num_heads=2, **overrides)
    with pytest.raises(ConfigError, match=message):
        write_hf(Transformer(config, key=jax.random.key(0)), tmp_path / "out")
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()


def test_export_refuses_a_non_empty_out(tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match="already exists and is not an empty folder"):
        write_hf(_swiglu_model(), tmp_path / "out")
    assert (tmp_path / "out" / "notes.txt").read_text() == "mine"


# -- --model.init-from and the --model flags ------------------------------------------------------------------


def _flags_config(folder: Path, **model_flags) -> Config:
    return Config(model=ModelFlags(init_from=folder, **model_flags), data=DataConfig(source="synthetic"))


def test_init_from_sets_the_shape_from_the_folder_and_flags_must_agree(tmp_path):
    folder = _write_folder(tmp_path / "m", _swiglu_model(tie_embeddings=True))
    config = _flags_config(folder, dtype="float32", remat="block")  # how it runs: free
    validate(config)
    m = config.model
    assert (m.vocab_size, m.num_layers, m.dim, m.num_heads, m.num_kv_heads, m.ffn_dim) == (VOCAB, 3, 32, 4, 2, 48)
    assert (m.mlp, m.norm_eps, m.rope_base, m.tie_embeddings, m.remat) == ("swiglu", 1e-5, 1000.0, True, "block")
    validate(_flags_config(folder, num_layers=3, dim=32))  # agreeing flags are fine
    for flags, message in [
        ({"num_layers": 4}, "--model.num-layers 4 contradicts num_hidden_layers 3 in "),
        ({"dim": 64}, "--model.dim 64 contradicts hidden_size 32"),
        ({"vocab_size": 100}, "--model.vocab-size 100 contradicts vocab_size 64"),
        ({"num_kv_heads": 4}, "--model.num-kv-heads 4 contradicts num_key_value_heads 2"),
        ({"mlp_ratio": 2}, "--model.mlp-ratio 64 contradicts intermediate_size 48"),
        ({"ffn_dim": 40}, "--model.ffn-dim 40 contradicts intermediate_size 48"),
        ({"norm_eps": 1e-3}, "--model.norm-eps 0.001 contradicts rms_norm_eps 1e-05"),
        ({"rope_base": 10.0}, "--model.rope-base 10.0 contradicts rope_theta 1000.0"),
        ({"kind": "moe"}, "--model.kind moe contradicts the LlamaForCausalLM layout of .* \\(which has --model.kind dense\\)"),
        ({"qkv_bias": True}, "--model.qkv-bias True contradicts the LlamaForCausalLM layout .* --model.qkv-bias False"),
    ]:
        with pytest.raises(ConfigError, match=message) as error:
            validate(_flags_config(folder, **flags))
        assert "\n" not in str(error.value)
    with pytest.raises(ConfigError, match="--model.init-from .* holds no config.json"):
        validate(_flags_config(tmp_path))


def test_init_from_replicas_and_global_model_start_from_the_folder(tmp_path, make_config):
    from eqx_diloco.lm import Trainer

    source = _swiglu_model()
    folder = _write_folder(tmp_path / "m", source)
    # Config() takes the folder's shape (TransformerConfig's defaults give way to it), as from the CLI.
    config = dataclasses.replace(make_config(), model=TransformerConfig(init_from=folder))
    assert config.model.num_layers == 3 and config.model.mlp == "swiglu" and config.diloco.num_replicas == 2
    trainer = Trainer(config, verbose=False)
    state, step = trainer.initial_state()
    assert step == 0
    expected = hf_tensors(source)
    for tree, replicated in [(state.global_params, False), (state.params, True)]:
        models = [jax.tree.map(lambda x, r=r: x[r], tree) for r in range(2)] if replicated else [tree]
        for model in models:
            for name, value in hf_tensors(model).items():
                np.testing.assert_array_equal(value, expected[name], err_msg=name)


# -- through the command lines: train, export --format hf, init-from (slow: they train) -----------------------

SMALL_RUN = ["--model.num-layers", "2", "--model.dim", "32", "--model.num-heads", "2", "--train.seq-len", "16",
             "--train.batch-size", "4", "--train.log-every", "1", "--train.eval-sequences", "4",
             "--diloco.sync-period", "3"]


def _bpe_tokenizer(folder: Path, text: str, vocab: int = 300) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([text], trainer=trainers.BpeTrainer(
        vocab_size=vocab, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    path = folder / "tokenizer.json"
    tok.save(str(path))
    return path


@pytest.mark.slow
def test_a_run_exports_to_hf_with_its_tokenizer_and_transformers_reads_both(hf, tmp_path, capsys):
    from tokenizers import Tokenizer

    from eqx_diloco.lm import prepare
    from eqx_diloco.lm.data import corpus_bytes
    from eqx_diloco.lm.export import main as export_main
    from eqx_diloco.lm.export import restore_global_model
    from eqx_diloco.lm.train import main as train_main

    text = corpus_bytes(12_000).decode("utf-8", errors="replace")
    (tmp_path / "corpus.txt").write_text(text)
    tokenizer = _bpe_tokenizer(tmp_path, text)
    assert prepare.main([str(tmp_path / "corpus.txt"), str(tmp_path / "tokens.bin"), "--tokenizer", str(tokenizer)]) == 0
    run = tmp_path / "run"
    assert train_main([*SMALL_RUN, "--model.mlp", "swiglu", "--model.num-kv-heads", "1", "--train.steps", "6",
                       "--checkpoint.every", "6", "--data.source", "tokens", "--data.path", str(tmp_path / "tokens.bin"),
                       "--run-dir", str(run)]) == 0
    capsys.readouterr()
    assert export_main([str(run), "--format", "hf"]) == 0
    assert f"to {run / 'hf'}/ (config.json, model.safetensors, tokenizer.json, tokenizer_config.json)" in \
        capsys.readouterr().out
    loaded = hf.transformers.AutoModelForCausalLM.from_pretrained(run / "hf", dtype=hf.torch.float32).eval()
    model, _, step = restore_global_model(run)
    assert step == 6 and loaded.config.max_position_embeddings == 16 and loaded.config.num_key_value_heads == 1
    ids = np.asarray(Tokenizer.from_file(str(tokenizer)).encode("def main():\n    return 0\n").ids)
    np.testing.assert_allclose(torch_logits(hf, loaded, ids), np.asarray(model(jnp.asarray(ids, jnp.int32))),
                               atol=1e-4, rtol=0)
    assert hf.transformers.AutoTokenizer.from_pretrained(run / "hf")("def main():\n    return 0\n",
                                                                      add_special_tokens=False)["input_ids"] == ids.tolist()
    # Exporting again into the same folder, and a layout Llama has not: one line each, nothing written.
    assert export_main([str(run), str(run / "hf"), "--format", "hf"]) == 2
    assert "already exists and is not an empty folder" in capsys.readouterr().err
    gelu = tmp_path / "gelu"
    assert train_main([*SMALL_RUN, "--train.steps", "2", "--checkpoint.every", "2", "--data.source", "synthetic",
                       "--run-dir", str(gelu)]) == 0
    capsys.readouterr()
    assert export_main([str(gelu), str(tmp_path / "gelu-hf"), "--format", "hf"]) == 2
    err = capsys.readouterr().err
    assert err == "error: --format hf: --model.mlp gelu has no Llama equivalent (Llama's MLP is --model.mlp swiglu)\n"
    assert not (tmp_path / "gelu-hf").exists()


@pytest.mark.slow
def test_a_diloco_run_continues_pretraining_from_an_exported_model(tmp_path, capsys):
    """Pretrain, export to HF, start a DiLoCo run of 2 replicas from the folder with no shape flags: its
    first losses are where the first run ended, far below a fresh model's, and it keeps learning."""
    from eqx_diloco.lm.export import main as export_main
    from eqx_diloco.lm.train import main as train_main
    from util import read_metrics

    first, second = tmp_path / "first", tmp_path / "second"
    assert train_main([*SMALL_RUN, "--model.mlp", "swiglu", "--model.num-kv-heads", "1", "--train.steps", "40",
                       "--train.lr", "1e-2", "--train.warmup-steps", "5", "--checkpoint.every", "40",
                       "--data.source", "synthetic", "--run-dir", str(first)]) == 0
    assert export_main([str(first), str(tmp_path / "hf"), "--format", "hf"]) == 0
    capsys.readouterr()
    assert train_main([*SMALL_RUN[6:], "--model.init-from", str(tmp_path / "hf"), "--train.steps", "9",
                       "--checkpoint.every", "0", "--data.source", "synthetic",
                       "--run-dir", str(second)]) == 0
    out = capsys.readouterr().out
    assert f"weights      from {tmp_path / 'hf'} (--model.init-from" in out
    assert "dense swiglu, 1 key/value heads of 2" in out
    saved = json.loads((second / "config.json").read_text())["model"]
    assert (saved["mlp"], saved["num_kv_heads"], saved["num_layers"], saved["dim"]) == ("swiglu", 1, 2, 32)
    before = [r["loss"] for r in read_metrics(first) if "loss" in r]
    after = [r["loss"] for r in read_metrics(second) if "loss" in r]
    assert before[0] > np.log(256) - 0.5 and before[-1] < before[0] - 1.5  # the first run learned
    # The second starts where the first ended (2.31 against 2.64 when written), not at a fresh model's 5.55.
    assert abs(after[0] - np.mean(before[-5:])) < 0.6 and after[0] < before[0] - 2, (after[:3], before[-5:])
    assert np.mean(after[-3:]) < after[0] + 0.2
    evals = [r["eval_loss"] for r in read_metrics(second) if "eval_loss" in r]
    assert evals[-1] < before[0] - 1.5


@pytest.mark.slow  # a fresh interpreter: this one has imported torch for the other tests
def test_the_package_never_imports_torch_or_transformers(tmp_path):
    import subprocess
    import sys

    folder = _write_folder(tmp_path / "m", _swiglu_model())
    code = ("import sys, eqx_diloco, eqx_diloco.lm, eqx_diloco.lm.train, eqx_diloco.lm.export, eqx_diloco.lm.hf, models; "
            "from eqx_diloco.lm.hf import load_hf_model, write_hf; "
            f"config, model = load_hf_model({str(folder)!r}); write_hf(model, {str(tmp_path / 'out')!r}); "
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers')); "
            "assert not bad, bad[:5]")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240,
                          cwd=Path(__file__).parents[1])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (tmp_path / "out" / "model.safetensors").is_file()


def test_a_checkpoint_resumes_without_init_from_but_not_with_another_shape(tmp_path):
    """`--model.init-from` gave the first weights only: a rerun may drop it or point elsewhere, as long as
    the model is the same. Checkpoints written before the Llama-layout fields resume as GELU models."""
    from eqx_diloco._json import to_jsonable
    from eqx_diloco.lm.resume import incompatibility

    folder = _write_folder(tmp_path / "m", _swiglu_model())
    saved = to_jsonable(_flags_config(folder))
    same = dataclasses.replace(saved_model := _flags_config(folder).model, init_from=None)
    assert saved_model.mlp == "swiglu"
    assert incompatibility(saved, Config(model=same, data=DataConfig(source="synthetic"))) is None
    other = dataclasses.replace(same, num_kv_heads=4)
    assert "--model.num-kv-heads 2 -> 4" in incompatibility(saved, Config(model=other, data=DataConfig(source="synthetic")))
    old = to_jsonable(Config())
    for field in ("mlp", "num_kv_heads", "ffn_dim", "norm_eps", "qkv_bias", "init_from"):
        del old["model"][field]
    assert incompatibility(old, Config()) is None
    assert "--model.mlp gelu -> swiglu" in incompatibility(old, Config(model=TransformerConfig(mlp="swiglu")))


def test_decoupled_islands_and_the_syncer_start_from_the_folder(tmp_path, make_config):
    """`--decoupled.role island|syncer` build their first model with `initial_model`, as the trainer does."""
    from eqx_diloco.lm.island import initial_model

    source = _swiglu_model(tie_embeddings=True)
    folder = _write_folder(tmp_path / "m", source)
    model = initial_model(dataclasses.replace(make_config(), model=TransformerConfig(init_from=folder)))
    expected = hf_tensors(source)
    for name, value in hf_tensors(model).items():
        np.testing.assert_array_equal(value, expected[name], err_msg=name)


def test_the_runs_tokenizer_is_named_even_when_its_file_is_gone(tmp_path):
    """Export says the run's tokenizer no longer exists (and writes none) instead of leaving it out silently."""
    from eqx_diloco.lm.hf import run_tokenizer

    tokens = tmp_path / "tokens.bin"
    tokens.write_bytes(b"\0\0")
    (tmp_path / "tokens.bin.json").write_text(json.dumps({"dtype": "uint16", "vocab_size": 64,
                                                          "tokenizer": str(tmp_path / "gone.json")}))
    config = Config(data=DataConfig(source="tokens", path=tokens))
    assert run_tokenizer(config) == tmp_path / "gone.json"
    assert run_tokenizer(Config(data=DataConfig(source="synthetic"))) is None
