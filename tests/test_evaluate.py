"""`python -m eqx_diloco.evaluate` and `--eval.tasks`: held-out loss, multiple-choice accuracy scored as
lm-evaluation-harness scores it, and one line for each bad input."""

import dataclasses
import json
import math
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eqx_diloco.lm.config import Config, ConfigError, EvalConfig, validate
from eqx_diloco.lm.evaluate import main, score
from eqx_diloco.lm.export import export, save_model
from eqx_diloco.lm.tasks import Question, Task, accuracies, encode_choice, read_task, score_batches
from eqx_diloco.lm.text_encoding import BYTES, tokenizer_for_tokens
from models import Transformer, TransformerConfig

from util import read_metrics

TINY = TransformerConfig(num_layers=1, dim=16, num_heads=2, mlp_ratio=2)
LETTERS = "abcdefghijklmnopqrstuvwxyz"


def _run(s: int, n: int) -> str:
    """n letters of the cyclic alphabet from letter s."""
    return "".join(LETTERS[(s + i) % 26] for i in range(n))


def pattern_corpus(num_lines: int, seed: int = 0) -> str:
    """Lines of 5 consecutive letters (the alphabet wraps), a space, and the next 5: a model that learned
    them knows how a line ends from how it starts; one that did not cannot."""
    starts = np.random.default_rng(seed).integers(0, 26, num_lines)
    return "".join(f"{_run(s, 5)} {_run(s + 5, 5)}\n" for s in starts)


def pattern_questions() -> list[dict]:
    """One question per start letter: the right ending among three wrong ones, one of them shorter."""
    rows = []
    for s in range(26):
        right = _run(s + 5, 5)
        wrong = [right[::-1], _run(s + 6, 5), _run(s + 13, 3)]
        label = s % 4
        choices = wrong[:label] + [right] + wrong[label:]
        rows.append({"context": "\n" + _run(s, 5), "choices": choices, "label": label})
    return rows


def write_jsonl(path, rows) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


# -- scoring as the harness does --------------------------------------------------------------------


def test_acc_takes_the_largest_sum_and_acc_norm_divides_by_characters():
    task = Task("t", None, (Question("q", ("a", "bbbb"), 1), Question("q", ("cc", "d"), 0)))
    # Question 1: -2 > -4 picks "a" (acc wrong); per character -2/1 < -4/4 picks "bbbb" (acc_norm right).
    # Question 2: -3 < -1 picks "d" (wrong); -3/2 < -1/1 picks "d" again (wrong).
    scores = accuracies(task, np.array([-2.0, -4.0, -3.0, -1.0]))
    assert scores == {"acc": 0.0, "acc_norm": 0.5}
    # Ties go to the first choice (numpy's argmax, as in the harness).
    assert accuracies(Task("t", None, (Question("q", ("x", "y"), 0),)), np.array([-1.0, -1.0]))["acc"] == 1.0


def test_the_continuation_is_a_space_and_the_choice_and_trailing_context_space_moves_to_it():
    assert encode_choice(BYTES, "ab", "cd") == (list(b"ab"), list(b" cd"))
    assert encode_choice(BYTES, "ab ", "cd") == (list(b"ab"), list(b"  cd"))
    assert encode_choice(BYTES, "é", "ü") == (list("é".encode()), list(" ü".encode()))


def test_batched_padded_scores_equal_one_sequence_at_a_time():
    model = Transformer(TINY, key=jax.random.key(0))
    rng = np.random.default_rng(0)
    context = 40  # buckets 32 and 40; a sequence of 60 ids keeps its last 41
    sequences = [(list(rng.integers(0, 256, length)), int(n)) for length, n in
                 [(3, 1), (10, 4), (33, 5), (34, 33), (41, 40), (60, 7), (20, 19)] * 3]
    batches = score_batches(sequences, context=context, vocab_size=TINY.vocab_size)
    assert {b.inputs.shape for b in batches} == {(64, 32), (64, 40)}  # one program per bucket, whatever the lengths
    got = score(model, batches, len(sequences))
    reference = jax.jit(lambda ids: jax.nn.log_softmax(model(ids), axis=-1))  # one unpadded sequence
    for (ids, n), value in zip(sequences, got):
        ids = np.asarray(ids[-(context + 1):], np.int32)
        logprobs = reference(jnp.asarray(ids[:-1]))
        expected = float(np.sum(np.asarray(logprobs)[np.arange(len(ids) - 1), ids[1:]][-n:]))
        assert value == pytest.approx(expected, rel=1e-5, abs=1e-4)


def test_a_tokenized_pair_is_split_after_the_contexts_own_encoding(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {"[UNK]": 0, "the": 1, "cat": 2, "sat": 3, "on": 4, "mat": 5}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokens.bin").write_bytes(np.array([1, 2], np.uint16).tobytes())
    (tmp_path / "tokens.bin.json").write_text(json.dumps(
        {"format": "eqx_diloco.tokens/1", "dtype": "uint16", "vocab_size": 6, "num_tokens": 2,
         "tokenizer": str(tmp_path / "tokenizer.json")}))
    encoder = tokenizer_for_tokens(tmp_path / "tokens.bin")
    assert encode_choice(encoder, "the cat", "sat on") == ([1, 2], [3, 4])


# -- bad input: one line each -----------------------------------------------------------------------


@pytest.fixture
def byte_model(tmp_path):
    path = tmp_path / "model.eqx"
    save_model(path, Transformer(TINY, key=jax.random.key(1)), {"seq_len": 32, "data_source": "corpus"})
    return path


GOOD = {"context": "abc", "choices": ["d", "e"], "label": 0}
BAD_TASKS = [
    ("missing-file", None, "no task file"),
    ("no-choices", [{"context": "abc", "label": 0}], "no choices"),
    ("empty-choices", [{"context": "abc", "choices": [], "label": 0}], "at least 2 choices"),
    ("one-choice", [{"context": "abc", "choices": ["d"], "label": 0}], "at least 2 choices"),
    ("label-out-of-range", [GOOD, {"context": "abc", "choices": ["d", "e"], "label": 2}], "out of range"),
    ("negative-label", [{"context": "abc", "choices": ["d", "e"], "label": -1}], "out of range"),
    ("no-label", [{"context": "abc", "choices": ["d", "e"]}], "no label"),
    ("empty-file", [], "holds no questions"),
    ("blank-lines-only", ["", "  "], "holds no questions"),
    ("not-json", [GOOD, "{context: abc"], "line 2 is not JSON"),
    ("not-an-object", [["abc", "d"]], "JSON object"),
    ("empty-choice", [{"context": "abc", "choices": ["d", ""], "label": 0}], "choice 1"),
    ("choice-not-text", [{"context": "abc", "choices": ["d", 3], "label": 0}], "choice 1"),
    ("no-context", [{"choices": ["d", "e"], "label": 0}], "no context"),
    ("label-not-an-index", [{"context": "abc", "choices": ["d", "e"], "label": "x"}], "index of the right choice"),
    ("arc-label-not-a-choice", [{"question": "q", "choices": {"text": ["d", "e"], "label": ["A", "B"]},
                                 "answerKey": "E"}], "none of the choice labels"),
]


@pytest.mark.parametrize("name,rows,message", BAD_TASKS, ids=[c[0] for c in BAD_TASKS])
def test_a_bad_task_file_is_one_line_naming_the_file(tmp_path, capsys, byte_model, name, rows, message):
    path = tmp_path / f"{name}.jsonl"
    if rows is not None:
        write_jsonl(path, rows)
    assert main([str(byte_model), "--tasks", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: --tasks: ") and message in err and str(path) in err
    # The trainer refuses the same file before JAX starts, naming its flag.
    with pytest.raises(ConfigError, match="^--eval.tasks: ") as refused:
        validate(Config(eval=EvalConfig(tasks=str(path))))
    assert str(path) in str(refused.value) and message in str(refused.value)


def test_a_decoupled_run_refuses_eval_tasks(tmp_path):
    from eqx_diloco.lm._decoupled_config import DecoupledConfig

    tasks = write_jsonl(tmp_path / "t.jsonl", [GOOD])
    config = Config(eval=EvalConfig(tasks=tasks), decoupled=DecoupledConfig(role="syncer"))
    with pytest.raises(ConfigError, match="^--eval.tasks is scored by the trainer's evaluations; a decoupled run"):
        validate(config)


def test_non_utf8_task_file_names_the_line(tmp_path, capsys, byte_model):
    path = tmp_path / "bytes.jsonl"
    path.write_bytes(json.dumps(GOOD).encode() + b"\n" + b'{"context": "\xff"}\n')
    assert main([str(byte_model), "--tasks", str(path)]) == 2
    assert "line 2 is not UTF-8" in capsys.readouterr().err


def test_hellaswag_and_arc_layouts_are_read(tmp_path):
    rows = [{"ctx": "A man", "endings": ["a", "b", "c", "d"], "label": "2"},
            {"question": "Which?", "choices": {"text": ["x", "y", "z"], "label": ["A", "B", "C"]}, "answerKey": "B"},
            {"question": "Which?", "choices": {"text": ["x", "y"], "label": ["1", "2"]}, "answerKey": "2"}]
    task = read_task(write_jsonl(tmp_path / "mixed.jsonl", rows), flag="--tasks")
    assert task.name == "mixed"
    assert [(q.context, q.choices, q.label) for q in task.questions] == [
        ("A man", ("a", "b", "c", "d"), 2), ("Which?", ("x", "y", "z"), 1), ("Which?", ("x", "y"), 1)]


def _none_of_three(tmp_path):
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "notes.txt").write_text("hello")
    (tmp_path / "weights.bin").write_bytes(b"\0" * 16)
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"algorithm": "diloco"}))  # a run that saved no checkpoint
    return [(folder, "none of"), (tmp_path / "weights.bin", "not an export"), (tmp_path / "absent", "does not exist"),
            (run, "no checkpoint")]


def test_a_model_path_that_is_none_of_the_three_is_one_line(tmp_path, capsys):
    tasks = write_jsonl(tmp_path / "t.jsonl", [GOOD])
    for path, message in _none_of_three(tmp_path):
        assert main([str(path), "--tasks", tasks]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("error: ") and message in err and str(path) in err


BAD_FLAGS = [
    (["--tokens", "{tmp}/absent.bin"], "--tokens"),
    (["--data.source", "text"], "--data.path"),
    (["--data.source", "text", "--data.path", "{tmp}/absent.txt"], "--data.path"),
    (["--data.eval-fraction", "1.5"], "--data.eval-fraction"),
    (["--tokens", "{tmp}/t.jsonl", "--data.source", "corpus"], "--tokens"),
    (["--sequences", "-1"], "--sequences"),
    (["--max-examples", "-1"], "--max-examples"),
    (["--context", "0"], "--context"),
    (["--tasks", "{tmp}/t.jsonl", "--tokenizer", "{tmp}/absent.json"], "--tokenizer"),
    ([], "nothing to evaluate"),
    (["--tasks", "{tmp}/long.jsonl"], "more than the model's context"),
    (["--tokens", "{tmp}/big_vocab.bin"], "more than the model's 256"),
    (["--tokens", "{tmp}/big_id.bin"], "found id 300"),
    (["--data.source", "tokens", "--data.path", "{tmp}/big_vocab.bin"], "more than the model's 256"),
    (["--tokens", "{tmp}/short.bin"], "fewer than one sequence"),
]


@pytest.mark.parametrize("flags,message", BAD_FLAGS, ids=[" ".join(f[0]).replace("{tmp}/", "") or "no-data"
                                                         for f in BAD_FLAGS])
def test_bad_flags_are_one_line_naming_the_flag(tmp_path, capsys, byte_model, flags, message):
    write_jsonl(tmp_path / "t.jsonl", [GOOD])
    write_jsonl(tmp_path / "long.jsonl", [{"context": "abc", "choices": ["d" * 40, "e"], "label": 0}])
    for name, ids, meta in [("big_vocab", np.arange(100), {"vocab_size": 1000}), ("big_id", [1, 300, 2] * 20, None),
                            ("short", np.arange(20), None)]:
        (tmp_path / f"{name}.bin").write_bytes(np.asarray(ids, np.uint16).tobytes())
        if meta:
            (tmp_path / f"{name}.bin.json").write_text(json.dumps({"dtype": "uint16", **meta}))
    flags = [f.replace("{tmp}", str(tmp_path)) for f in flags]
    assert main([str(byte_model), *flags]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and message in err


def test_a_token_run_without_its_tokenizer_is_one_line(tmp_path, capsys):
    (tmp_path / "tokens.bin").write_bytes(np.arange(100, dtype=np.uint16).tobytes())
    (tmp_path / "tokens.bin.json").write_text(json.dumps({"dtype": "uint16", "vocab_size": 300}))
    tasks = write_jsonl(tmp_path / "t.jsonl", [GOOD])
    with pytest.raises(ConfigError, match="--eval.tasks needs the tokenizer of .*names no tokenizer file"):
        from eqx_diloco.lm.text_encoding import encoder_for_data

        encoder_for_data("tokens", tmp_path / "tokens.bin", needed_by="--eval.tasks")
    path = tmp_path / "ids.eqx"
    save_model(path, Transformer(dataclasses.replace(TINY, vocab_size=300), key=jax.random.key(0)),
               {"seq_len": 16, "data_source": "tokens"})
    assert main([str(path), "--tasks", tasks]) == 2
    assert "--tokenizer" in capsys.readouterr().err


def test_a_hugging_face_folder_is_read_by_load_hf_model(tmp_path, capsys, monkeypatch):
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"],
                                                    "max_position_embeddings": 64}))
    calls = []

    def load_hf_model(path):
        calls.append(path)
        return TINY, Transformer(TINY, key=jax.random.key(0))

    monkeypatch.setitem(sys.modules, "eqx_diloco.lm.hf", types.SimpleNamespace(load_hf_model=load_hf_model))
    assert main([str(folder), "--tasks", write_jsonl(tmp_path / "t.jsonl", [GOOD])]) == 2
    assert calls == [folder]
    assert "has no tokenizer.json" in capsys.readouterr().err
    (tmp_path / "tokens.bin").write_bytes(np.arange(200, dtype=np.uint16).tobytes())
    assert main([str(folder), "--tokens", str(tmp_path / "tokens.bin"), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    # 200 tokens hold windows of 65 at 0, 64 and 128.
    assert result["kind"] == "hf" and result["context"] == 64 and result["held_out"]["tokens"] == 3 * 64


# -- a trained model gets the answers right, an untrained one cannot -------------------------------


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    """A DiLoCo run (2 replicas) of 300 steps on the pattern corpus, with the questions as --eval.tasks."""
    from conftest import tiny_config
    from eqx_diloco.lm.trainer import train

    tmp = tmp_path_factory.mktemp("pattern")
    (tmp / "corpus.txt").write_text(pattern_corpus(4000))
    tasks = write_jsonl(tmp / "pattern.jsonl", pattern_questions())
    config = tiny_config(tmp / "run", train={"steps": 300, "seq_len": 32, "batch_size": 8, "lr": 3e-3,
                                             "warmup_steps": 20, "eval_every": 150, "log_every": 50},
                         diloco={"sync_period": 10}, data={"source": "text", "path": tmp / "corpus.txt"},
                         checkpoint={"every": 300})
    config = dataclasses.replace(config, eval=EvalConfig(tasks=tasks))
    train(config, verbose=False)
    return tmp, config


@pytest.mark.slow
def test_training_scores_the_tasks_into_metrics_and_tensorboard(trained_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tmp, config = trained_run
    evals = {r["step"]: r for r in read_metrics(config.run_dir) if "eval_loss" in r}
    assert sorted(evals) == [0, 150, 300]
    assert evals[0]["eval/pattern/acc"] <= 0.5 and evals[0]["eval/pattern/acc_norm"] <= 0.5
    assert evals[300]["eval/pattern/acc"] == 1.0 and evals[300]["eval/pattern/acc_norm"] == 1.0
    acc = EventAccumulator(str(config.run_dir))
    acc.Reload()
    tensorboard = {e.step: e.value for e in acc.Scalars("eval/pattern/acc_norm")}
    assert tensorboard == {s: pytest.approx(evals[s]["eval/pattern/acc_norm"]) for s in evals}  # float32 there


@pytest.mark.slow
def test_evaluate_an_export_a_run_folder_and_an_untrained_model(trained_run, capsys):
    tmp, config = trained_run
    tasks = str(tmp / "pattern.jsonl")
    export(config.run_dir, tmp / "model.eqx")
    results = {}
    for name, model in [("export", tmp / "model.eqx"), ("run", config.run_dir)]:
        assert main([str(model), "--tasks", tasks, "--json"]) == 0
        results[name] = json.loads(capsys.readouterr().out)
    exported, run = results["export"], results["run"]
    assert exported["tasks"]["pattern"] == run["tasks"]["pattern"]
    assert exported["tasks"]["pattern"]["acc"] == 1.0 and exported["tasks"]["pattern"]["acc_norm"] == 1.0
    # The loss on the run's own held-out split (its --data flags, read from the run folder).
    held_out = exported["held_out"]
    assert held_out == run["held_out"] and held_out["tokens"] > 0
    assert held_out["perplexity"] == pytest.approx(math.exp(held_out["loss"]))
    last_eval = [r["eval_loss"] for r in read_metrics(config.run_dir) if "eval_loss" in r][-1]
    assert held_out["loss"] == pytest.approx(last_eval, rel=0.1)  # other windows of the same split
    # Lines for people; --data flags override the run's.
    assert main([str(tmp / "model.eqx"), "--tasks", tasks, "--data.eval-fraction", "0.2", "--sequences", "4"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].startswith("held-out loss") and "on 128 tokens" in lines[1] and "0.2" in lines[1]
    assert lines[2].startswith("pattern: acc 1.0000  acc_norm 1.0000  (26 questions)")
    # The same shape untrained: it cannot tell the endings apart.
    untrained = tmp / "untrained.eqx"
    save_model(untrained, Transformer(config.model, key=jax.random.key(7)), {"seq_len": 32, "data_source": "text"})
    assert main([str(untrained), "--tasks", tasks, "--json"]) == 0
    scores = json.loads(capsys.readouterr().out)["tasks"]["pattern"]
    assert scores["acc"] <= 0.5 and scores["acc_norm"] <= 0.5


@pytest.mark.slow
def test_task_scores_of_a_sharded_island_equal_the_exported_models(tmp_path, capsys):
    """Islands of 4 devices (fsdp 2 x tensor 2): the trainer scores the tasks on the sharded global model;
    `evaluate` on its export (one device) gives the same accuracies."""
    from conftest import tiny_config
    from eqx_diloco.lm.trainer import train

    rows = pattern_questions()
    tasks = write_jsonl(tmp_path / "pattern.jsonl", rows)
    config = tiny_config(tmp_path / "run", train={"steps": 4, "eval_every": 4, "seq_len": 32},
                         mesh={"fsdp": 2, "tensor": 2}, checkpoint={"every": 4})
    train(dataclasses.replace(config, eval=EvalConfig(tasks=tasks, max_examples=10)), verbose=False)
    last = [r for r in read_metrics(config.run_dir) if "eval_loss" in r][-1]
    export(config.run_dir, tmp_path / "model.eqx")
    assert main([str(tmp_path / "model.eqx"), "--tasks", tasks, "--max-examples", "10", "--json"]) == 0
    scores = json.loads(capsys.readouterr().out)["tasks"]["pattern"]
    assert scores["questions"] == 10
    assert (last["step"], last["eval/pattern/acc"], last["eval/pattern/acc_norm"]) == (4, scores["acc"],
                                                                                      scores["acc_norm"])


@pytest.mark.slow
def test_the_command_runs_as_a_module(tmp_path, byte_model):
    import subprocess

    tasks = write_jsonl(tmp_path / "t.jsonl", [GOOD, {"context": "x y", "choices": ["z", "w", "v"], "label": 2}])
    done = subprocess.run([sys.executable, "-m", "eqx_diloco.evaluate", str(byte_model), "--tasks", tasks],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1].startswith("t: acc ") and done.stdout.rstrip().endswith("(2 questions)")
    refused = subprocess.run([sys.executable, "-m", "eqx_diloco.evaluate", str(tmp_path)], capture_output=True,
                             text=True, timeout=300)
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1 and "none of" in refused.stderr


@pytest.mark.slow
def test_two_processes_score_the_tasks(tmp_path):
    """An island per process: each places the same rows on the shared mesh, process 0 writes the scores."""
    import subprocess

    tasks = write_jsonl(tmp_path / "pattern.jsonl", pattern_questions())
    run_dir = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, "-m", "eqx_diloco.launch", "--num-processes", "2", "--", "--diloco.num-replicas", "2",
         "--diloco.sync-period", "5", "--train.steps", "10", "--train.eval-every", "10", "--train.seq-len", "32",
         "--model.num-layers", "1", "--model.dim", "32", "--eval.tasks", tasks, "--run-dir", str(run_dir)],
        capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    evals = [r for r in read_metrics(run_dir) if "eval_loss" in r]
    assert [r["step"] for r in evals] == [0, 10]
    assert all(0 <= r[f"eval/pattern/{k}"] <= 1 for r in evals for k in ("acc", "acc_norm"))
    assert "pattern acc" in done.stdout
