"""The README's "Your own model and data" commands work, typed in order, on a tiny random Llama.

The block marked `<!-- own-model -->` is read from README.md and each `python -m eqx_diloco.*` command
runs in a fresh folder (the cwd) as written, in process through the command's `main`. The files the
commands name are made first: `my_llama/` (a random `transformers` Llama of 2 layers with its own
`tokenizers` BPE tokenizer), `my_corpus/` (two jsonl shards with a `text` field) and `my_task.jsonl`.
Training gets tiny-run flags appended (the README's flags stay and come first), so this checks the
commands' wiring and the files they hand on, not numbers.
"""

import json
import re
import shlex
from pathlib import Path

import numpy as np
import pytest

README = Path(__file__).parents[1] / "README.md"
TINY_TRAIN = ["--train.steps", "6", "--train.batch-size", "2", "--train.seq-len", "16", "--diloco.sync-period", "3",
              "--train.eval-every", "0", "--train.eval-sequences", "2", "--checkpoint.every", "6"]


def own_model_commands() -> list[list[str]]:
    block = re.search(r"<!-- own-model -->\s*```(?:bash|sh)?\n(.*?)```", README.read_text(), re.S)
    assert block, "README.md lost its <!-- own-model --> block"
    commands = [shlex.split(line, comments=True) for line in block.group(1).splitlines()]
    return [args for args in commands if args[:2] == ["python", "-m"]]


def test_the_block_runs_prepare_init_from_train_export_evaluate_in_order():
    modules = [args[2] for args in own_model_commands()]
    assert modules == ["eqx_diloco.prepare", "eqx_diloco.train", "eqx_diloco.export", "eqx_diloco.evaluate"]


def _make_inputs(folder: Path) -> None:
    """my_llama/ (random Llama, tokenizer.json), my_corpus/ (2 jsonl shards), my_task.jsonl."""
    import torch
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from eqx_diloco.lm.data import corpus_bytes

    text = corpus_bytes(40_000).decode("utf-8", errors="replace")
    documents = [d for d in text.split("\n\n") if d.strip()]
    corpus = folder / "my_corpus"
    corpus.mkdir()
    half = len(documents) // 2
    for i, part in enumerate([documents[:half], documents[half:]]):
        (corpus / f"shard-{i}.jsonl").write_text("".join(json.dumps({"text": d, "id": n}) + "\n"
                                                          for n, d in enumerate(part)))

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(documents, trainer=trainers.BpeTrainer(
        vocab_size=320, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    llama = folder / "my_llama"
    config = transformers.LlamaConfig(vocab_size=tokenizer.get_vocab_size(), hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=64, tie_word_embeddings=False)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(llama)
    tokenizer.save(str(llama / "tokenizer.json"))

    (folder / "my_task.jsonl").write_text("".join(json.dumps(row) + "\n" for row in [
        {"context": "def main():", "choices": ["return 0", "import os"], "label": 0},
        {"context": "for i in", "choices": ["range(3):", "class A:"], "label": 0}]))


@pytest.mark.slow
def test_the_readme_own_model_commands_run_in_order(tmp_path, monkeypatch, capsys):
    from eqx_diloco.lm import evaluate, export, prepare, train

    _make_inputs(tmp_path)
    monkeypatch.chdir(tmp_path)
    mains = {"eqx_diloco.prepare": prepare.main, "eqx_diloco.train": train.main,
             "eqx_diloco.export": export.main, "eqx_diloco.evaluate": evaluate.main}
    for args in own_model_commands():
        argv = args[3:] + (TINY_TRAIN if args[2] == "eqx_diloco.train" else [])
        code = mains[args[2]](argv)
        out = capsys.readouterr()
        assert code == 0, f"{shlex.join(args)} exited {code}:\n{out.err[-2000:]}"

    # Each command handed on what the next reads: token shards with the tokenizer beside them, a run
    # that started from the Llama, an HF folder with its tokenizer, and scores of that folder.
    from eqx_diloco.lm.token_shards import tokenizer_file_for_tokens

    assert tokenizer_file_for_tokens(tmp_path / "data/tokens") is not None
    exported = tmp_path / "runs/mine/hf"
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in exported.iterdir()}
    assert json.loads((exported / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    assert "held-out loss" in out.out and "my_task: acc" in out.out, out.out
    # The exported weights moved away from the Llama's (training happened) and load in transformers.
    import transformers

    before = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "my_llama")
    after = transformers.AutoModelForCausalLM.from_pretrained(exported)
    moved = [not np.array_equal(p.detach().numpy(), q.detach().numpy())
             for p, q in zip(before.parameters(), after.parameters(), strict=True)]
    assert all(moved), moved
