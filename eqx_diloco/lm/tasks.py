"""Multiple-choice tasks from local jsonl files, scored as lm-evaluation-harness scores them.

A task file holds one question per line: a JSON object with a `context` (the text before the answer), its
`choices` (two or more non-empty strings) and the `label` (the index of the right choice). HellaSwag's and
ARC's own field names are read too (see `read_question`). Each choice is scored by the summed
log-likelihood of its tokens after the context, the continuation being `" " + choice` (the harness's
default target delimiter):

- `acc`: the question counts as right when the right choice has the highest log-likelihood;
- `acc_norm`: the same after dividing each choice's log-likelihood by its length in characters
  (`len(choice)` of the choice string, without the delimiter), as the harness does.

Nothing here imports JAX: the text is read and encoded, and the padded batches the model scores are
built, on the host (`score_batches`); `evaluate.py` runs them.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from .._errors import ConfigError
from .text_encoding import TextEncoder

TARGET_DELIMITER = " "  # lm-evaluation-harness's default between the context and each choice
CONTEXT_KEYS = ("context", "ctx", "query", "question")  # ours, HellaSwag's, the harness's, ARC's
CHOICE_KEYS = ("choices", "endings")  # ours and ARC's (a list, or {"text": [...], "label": [...]}), HellaSwag's
LABEL_KEYS = ("label", "answerKey", "gold")  # ours and HellaSwag's, ARC's, the harness's


@dataclasses.dataclass(frozen=True)
class Question:
    """One multiple-choice question: `context`, its `choices`, and `label`, the index of the right one."""

    context: str
    choices: tuple[str, ...]
    label: int


@dataclasses.dataclass(frozen=True)
class Task:
    """The questions of one task file; `name` is the file's name without `.jsonl`."""

    name: str
    path: Path
    questions: tuple[Question, ...]


def _first_key(row: dict, keys: tuple[str, ...]) -> str | None:
    return next((k for k in keys if k in row), None)


def _text(value: Any, what: str, where: str) -> str:
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{where}: {what} must be a non-empty string (got {json.dumps(value)[:60]})")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate written as a \ud800 escape
        raise ConfigError(f"{where}: {what} is not valid Unicode (a lone surrogate escape)") from None
    return value


def read_question(row: Any, where: str) -> Question:
    """A `Question` from one parsed jsonl line; `where` (file and line) starts every error message.

    Fields, each the first of these keys present: the context from `context`, `ctx` (HellaSwag), `query`
    or `question` (ARC); the choices from `choices` (a list of strings, or ARC's `{"text": [...], "label":
    [...]}`) or `endings` (HellaSwag); the label from `label`, `answerKey` (ARC) or `gold`: an index, a
    string of digits, or one of ARC's choice labels ("A", "B", ...).
    """
    if not isinstance(row, dict):
        raise ConfigError(f"{where}: a question must be a JSON object with context, choices and label")
    context_key, choices_key, label_key = (_first_key(row, keys) for keys in (CONTEXT_KEYS, CHOICE_KEYS, LABEL_KEYS))
    if context_key is None:
        raise ConfigError(f"{where}: the question has no context (a \"context\" field)")
    context = _text(row[context_key], f'"{context_key}"', where)
    if choices_key is None:
        raise ConfigError(f"{where}: the question has no choices (a \"choices\" list)")
    choices, choice_labels = row[choices_key], None
    if isinstance(choices, dict) and "text" in choices:  # ARC: {"text": [...], "label": ["A", "B", ...]}
        choice_labels = choices.get("label")
        choices = choices["text"]
    if not isinstance(choices, list) or len(choices) < 2:
        count = len(choices) if isinstance(choices, list) else "none"
        raise ConfigError(f"{where}: \"{choices_key}\" must be a list of at least 2 choices (got {count})")
    choices = tuple(_text(c, f'choice {i}', where) for i, c in enumerate(choices))
    if label_key is None:
        raise ConfigError(f"{where}: the question has no label (a \"label\" field: the index of the right choice)")
    label = _label(row[label_key], choice_labels, f'"{label_key}"', where)
    if not 0 <= label < len(choices):
        raise ConfigError(f"{where}: \"{label_key}\" {label} is out of range for {len(choices)} choices "
                          f"(an index from 0 to {len(choices) - 1})")
    return Question(context, choices, label)


def _label(value: Any, choice_labels: Any, what: str, where: str) -> int:
    if isinstance(choice_labels, list) and value in choice_labels:
        return choice_labels.index(value)
    if isinstance(choice_labels, list) and isinstance(value, str) and not value.strip().isdigit():
        raise ConfigError(f"{where}: {what} {json.dumps(value)[:20]} is none of the choice labels "
                          f"{json.dumps(choice_labels)[:60]}")
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        return int(value)
    raise ConfigError(f"{where}: {what} must be the index of the right choice (got {json.dumps(value)[:40]})")


def read_task(path: Path | str, *, flag: str) -> Task:
    """The questions of jsonl file `path` (blank lines skipped). `flag` names the argument in errors."""
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"{flag}: no task file at {path}")
    if not path.is_file():
        raise ConfigError(f"{flag}: {path} is not a regular file")
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        line = path.read_bytes()[: e.start].count(b"\n") + 1
        raise ConfigError(f"{flag}: {path} line {line} is not UTF-8 text") from None
    except OSError as e:
        raise ConfigError(f"{flag}: {path} is not readable ({e.strerror})") from None
    questions = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{flag}: {path} line {number}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{where} is not JSON ({e.msg})") from None
        questions.append(read_question(row, where))
    if not questions:
        raise ConfigError(f"{flag}: {path} holds no questions (one JSON object per line)")
    name = path.name[: -len(".jsonl")] if path.name.endswith(".jsonl") else path.stem
    return Task(name, path, tuple(questions))


def task_paths(spec: str | None) -> list[Path]:
    """The files of a comma-separated `--eval.tasks` value (none for None or an empty string)."""
    return [Path(p.strip()) for p in (spec or "").split(",") if p.strip()]


def read_tasks(spec: str | None, *, flag: str) -> list[Task]:
    """Every task of a comma-separated list of jsonl files; two files of the same name are refused (the name
    is the task's key in the metrics)."""
    tasks = [read_task(p, flag=flag) for p in task_paths(spec)]
    names = [t.name for t in tasks]
    for task in tasks:
        if names.count(task.name) > 1:
            raise ConfigError(f"{flag}: two task files are named {task.name} (the name keys the metrics): rename one")
    return tasks


def encode_choice(encoder: TextEncoder, context: str, choice: str) -> tuple[list[int], list[int]]:
    """(context ids, continuation ids) for `choice` after `context`, split as the harness splits them: the
    context's trailing whitespace moves to the continuation, the pair is encoded whole and the continuation
    is what follows the context's own encoding (a tokenizer may merge across the boundary)."""
    continuation = TARGET_DELIMITER + choice
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    context_ids = encoder.encode(context)
    whole = encoder.encode(context + continuation)
    return context_ids, whole[len(context_ids):]


@dataclasses.dataclass(frozen=True)
class ScoreBatch:
    """Padded rows for one call of the scoring program: each row is a token sequence whose positions with
    `mask` set are summed (the log-probability of `targets` there). `rows` gives each row's index in the
    caller's list (-1 for a padding row)."""

    inputs: np.ndarray  # int32 (batch, length)
    targets: np.ndarray  # int32 (batch, length)
    mask: np.ndarray  # bool (batch, length)
    rows: np.ndarray  # int64 (batch,)


def bucket_lengths(context: int, smallest: int = 32) -> list[int]:
    """The padded lengths rows are rounded up to: powers of two from `smallest`, then `context` itself.
    A few programs compile, whatever the lengths of the questions."""
    lengths, n = [], smallest
    while n < context:
        lengths.append(n)
        n *= 2
    return lengths + [context]


def rows_per_batch(length: int, vocab_size: int, *, logit_budget: int = 1 << 26, most: int = 64) -> int:
    """Rows per scoring call at a padded `length`: as many as keep the float32 logits (rows x length x
    vocabulary) within `logit_budget` values (256 MiB), at least 1 and at most `most`."""
    return max(1, min(most, logit_budget // max(1, length * vocab_size)))


def score_batches(sequences: list[tuple[list[int], int]], *, context: int, vocab_size: int) -> list[ScoreBatch]:
    """Padded batches for `sequences`, each (token ids, n): the log-probability of the last n ids given the
    ones before. A sequence longer than `context + 1` keeps its last `context + 1` ids (the harness's left
    truncation). Rows of similar length share a bucket (`bucket_lengths`); each bucket's last batch is
    filled with padding rows, so every call of a bucket has one shape."""
    buckets = bucket_lengths(context)
    by_bucket: dict[int, list[tuple[int, np.ndarray, np.ndarray, int]]] = {}
    for index, (ids, n) in enumerate(sequences):
        if not 1 <= n <= context or len(ids) < n + 1:
            raise ValueError(f"sequence {index}: {n} scored ids of {len(ids)} do not fit a context of {context}")
        ids = np.asarray(ids[-(context + 1):], np.int32)
        length = next(b for b in buckets if b >= len(ids) - 1)
        by_bucket.setdefault(length, []).append((index, ids[:-1], ids[1:], n))
    batches = []
    for length, items in sorted(by_bucket.items()):
        size = rows_per_batch(length, vocab_size)
        for start in range(0, len(items), size):
            chunk = items[start:start + size]
            inputs = np.zeros((size, length), np.int32)
            targets = np.zeros((size, length), np.int32)
            mask = np.zeros((size, length), bool)
            rows = np.full((size,), -1, np.int64)
            for r, (index, x, y, n) in enumerate(chunk):
                inputs[r, :len(x)], targets[r, :len(y)] = x, y
                mask[r, len(y) - n:len(y)] = True
                rows[r] = index
            batches.append(ScoreBatch(inputs, targets, mask, rows))
    return batches


@dataclasses.dataclass(frozen=True)
class EncodedTask:
    """A task ready to score: its questions' rows (one per choice, `Question` order) in padded batches."""

    task: Task
    batches: list[ScoreBatch]
    num_rows: int


def encode_task(task: Task, encoder: TextEncoder, *, context: int, vocab_size: int, max_questions: int = 0,
                flag: str) -> EncodedTask:
    """Encode every choice of `task` (the first `max_questions` questions; 0 = all) and batch them. A choice
    whose continuation does not fit `context` tokens, or an id beyond `vocab_size`, is refused in one line."""
    questions = task.questions[:max_questions] if max_questions > 0 else task.questions
    task = dataclasses.replace(task, questions=questions)
    sequences = []
    for number, question in enumerate(questions, start=1):
        for k, choice in enumerate(question.choices):
            context_ids, continuation = encode_choice(encoder, question.context, choice)
            where = f"{flag}: {task.path} question {number} choice {k}"
            if not context_ids:
                raise ConfigError(f"{where}: the context encodes to no tokens")
            if len(continuation) > context:
                raise ConfigError(f"{where} is {len(continuation)} tokens, more than the model's context of {context}")
            largest = max(context_ids + continuation)
            if largest >= vocab_size:
                raise ConfigError(f"{where} encodes to id {largest} ({encoder.source}), beyond the model's "
                                  f"vocabulary of {vocab_size}")
            sequences.append((context_ids + continuation, len(continuation)))
    return EncodedTask(task, score_batches(sequences, context=context, vocab_size=vocab_size), len(sequences))


def accuracies(task: Task, loglikelihoods: np.ndarray) -> dict[str, float]:
    """`acc` and `acc_norm` of `task` from the summed log-likelihood of each choice, in question order.
    Ties go to the first choice (numpy's argmax, as in the harness)."""
    right = right_norm = 0
    offset = 0
    for question in task.questions:
        lls = np.asarray(loglikelihoods[offset:offset + len(question.choices)], np.float64)
        offset += len(question.choices)
        lengths = np.array([len(c) for c in question.choices], np.float64)
        right += int(np.argmax(lls)) == question.label
        right_norm += int(np.argmax(lls / lengths)) == question.label
    if offset != len(loglikelihoods):
        raise ValueError(f"{len(loglikelihoods)} log-likelihoods for {offset} choices")
    n = len(task.questions)
    return {"acc": right / n, "acc_norm": right_norm / n}


def perplexity(loss: float) -> float:
    """exp(loss) of a mean next-token loss in nats (inf where it overflows)."""
    return math.exp(loss) if loss < 700 else math.inf
