"""Tests for moe_rl.tasks: exact rewards, seeded datasets, the character-level tokenizer."""

from __future__ import annotations

import random
from fractions import Fraction

import pytest
from transformers import PreTrainedTokenizerFast

from moe_rl.tasks import (
    ALPHABET,
    TASKS,
    get_task,
    load_task,
    make_tokenizer,
    parse_expression,
    score_completions,
)

REV = {"prompt": "R3071=", "answer": "1703", "digits": "3071"}
SORT = {"prompt": "S3071=", "answer": "0137", "digits": "3071"}
ADD = {"prompt": "A57+968=", "answer": "1025", "a": 57, "b": 968}
CD = {"prompt": "C3,5,7>22:", "answer": "3*5+7", "numbers": [3, 5, 7], "target": 22}
RSUM = {"prompt": "P3071=", "answer": "3301", "digits": "3071"}

MALFORMED = ["", "   ", "abc", "1/0", "((((", "9" * 10_000, "(3*5+7" * 1000, "<eos>", None]

# (task, example, correct, wrong but well-formed, extra malformed)
CASES = [
    ("reversal", REV, "1703", "3071", ["170", "17034", "17a3", "1703=", "17 03", "١٧٠٣"]),
    ("sorting", SORT, "0137", "7310", ["013", "01377", "0-37"]),
    ("running_sum", RSUM, "3301", "3071", ["330", "33011", "33-1"]),
    ("addition", ADD, "1025", "1024", ["10250", "+1025", "1,025", "57+968", "-3"]),
    ("countdown", CD, "3*5+7", "3+5+7", ["3*5+", "3*5+7=22", "3*5+7)", "3 5 7", "-3+5*5", "3^5"]),
]


@pytest.mark.parametrize("name, example, correct, wrong, bad", CASES)
def test_reward_hand_checked(name, example, correct, wrong, bad):
    task = get_task(name)
    assert task.reward(correct, example) == 1.0
    assert task.reward(f"  {correct}\n", example) == 1.0  # surrounding whitespace is stripped
    assert task.reward(correct, example, partial_credit=0.1) == 1.0
    assert task.reward(wrong, example) == 0.0
    assert task.reward(wrong, example, partial_credit=0.1) == 0.1
    for text in MALFORMED + bad:
        assert task.reward(text, example) == 0.0, text
        assert task.reward(text, example, partial_credit=0.1) == 0.0, text


def test_addition_wellformed_lengths_and_leading_zero():
    task = get_task("addition")
    # sum of a 2- and a 3-digit number has at most 4 digits
    assert task.reward("7", ADD, partial_credit=0.5) == 0.5
    assert task.reward("9999", ADD, partial_credit=0.5) == 0.5
    assert task.reward("99999", ADD, partial_credit=0.5) == 0.0
    assert task.reward("01025", ADD, partial_credit=0.5) == 0.0  # too long, not canonical
    assert task.reward("0763", {"answer": "763", "a": 755, "b": 8}, partial_credit=0.5) == 0.5


def test_countdown_alternatives_and_number_use():
    task, ex = get_task("countdown"), CD
    for ok in ["7+5*3", "5*3+7", "(3*5)+7", "((7))+3*5", "7 + 3 * 5"]:
        assert task.reward(ok, ex) == 1.0, ok
    # well-formed but wrong: reused number, missing number, extra number, wrong value, 15 != 5
    for wrong in ["3*5+7+3", "5*5-3", "3*5", "3*5+7-0", "15+7", "35-13", "3*(5+7)"]:
        assert task.reward(wrong, ex) == 0.0, wrong
        assert task.reward(wrong, ex, partial_credit=0.25) == 0.25, wrong
    # exact (Fraction) division: 6/4*2 == 3; float-style shortcuts do not apply
    ex2 = {"numbers": [6, 4, 2], "target": 3}
    assert task.reward("6/4*2", ex2) == 1.0
    assert task.reward("6/(4*2)", ex2, partial_credit=0.1) == 0.1
    assert task.reward("6/(4-4)", ex2, partial_credit=0.1) == 0.0  # division by zero
    assert task.reward("06/4*2", ex2, partial_credit=0.1) == 0.1  # "06" is not the number 6


def test_parse_expression():
    assert parse_expression("3*5+7") == (Fraction(22), ["3", "5", "7"])
    assert parse_expression("8-(2-3)*2") == (Fraction(10), ["8", "2", "3", "2"])
    assert parse_expression("1/3+1/6") == (Fraction(1, 2), ["1", "3", "1", "6"])
    for bad in ["", "1/0", "(((( ", "1+", "-1", "2**3", "1e3", "__import__('os')", "1" * 65, "²+1"]:
        assert parse_expression(bad) is None, bad


@pytest.mark.parametrize("name, kwargs", [(n, {}) for n in TASKS] + [("countdown", {"n_numbers": 4})])
def test_demonstrations_score_one(name, kwargs):
    task, rng = get_task(name), random.Random(123)
    alphabet = set(ALPHABET)
    max_chars = 25 if kwargs else 24  # 4 numbers: "C9,9,9,9>6561:" + an 11-char expression
    for _ in range(200):
        ex = task.make_example(rng, **kwargs)
        assert task.reward(ex["answer"], ex) == 1.0, ex
        assert ex["prompt"][0] in task.prefix and ex["prompt"][-1] in "=:"
        assert set(ex["prompt"] + ex["answer"]) <= alphabet
        assert len(ex["prompt"]) + len(ex["answer"]) <= max_chars


def test_task_examples_and_prefixes():
    assert sorted(TASKS) == ["addition", "countdown", "mixture", "reversal", "running_sum", "sorting"]
    single = [t.prefix for n, t in TASKS.items() if n != "mixture"]
    assert len(set(single)) == 5 and all(len(p) == 1 for p in single)
    ex = get_task("countdown").make_example(random.Random(0))
    assert set(ex) == {"prompt", "answer", "numbers", "target"}
    assert len(ex["numbers"]) == 3 and all(1 <= n <= 9 for n in ex["numbers"]) and ex["target"] > 0
    assert ex["prompt"] == "C" + ",".join(map(str, ex["numbers"])) + f">{ex['target']}:"
    ex = get_task("reversal").make_example(random.Random(0), min_len=8, max_len=8)
    assert len(ex["answer"]) == 8 and ex["answer"] == ex["digits"][::-1]
    with pytest.raises(ValueError, match="valid tasks"):
        get_task("multiplication")
    with pytest.raises(ValueError):
        get_task("reversal").make_example(random.Random(0), min_len=5, max_len=2)
    with pytest.raises(TypeError):
        get_task("reversal").make_example(random.Random(0), n_numbers=3)


def test_running_sum_by_hand_and_at_length():
    task = get_task("running_sum")
    assert task.solve("3071") == "3301" and task.solve("99999") == "98765" and task.solve("0") == "0"
    ex = task.make_example(random.Random(0), min_len=48, max_len=48)
    digits, answer = ex["digits"], ex["answer"]
    assert len(answer) == 48 and ex["prompt"] == f"P{digits}="
    assert all(int(answer[t]) == sum(map(int, digits[: t + 1])) % 10 for t in range(48))
    # an error at one position carries into every later digit: one wrong digit, one wrong answer
    assert task.reward(answer[:-1] + str((int(answer[-1]) + 1) % 10), ex) == 0.0
    assert task.longest_answer(min_len=48, max_len=48) == 48 and get_task("addition").longest_answer() is None


def test_a_mixture_draws_each_part_under_its_own_prefix():
    task, rng = get_task("mixture"), random.Random(0)
    examples = [task.make_example(rng) for _ in range(300)]
    counts = {n: sum(e["task"] == n for e in examples) for n in ("reversal", "sorting", "running_sum")}
    assert sum(counts.values()) == 300 and min(counts.values()) > 70  # uniform: 100 each, SD ~8
    for e in examples:
        part = get_task(e["task"])
        assert e["prompt"] == f"{part.prefix}{e['digits']}=" and e["answer"] == part.solve(e["digits"])
    # the same digits, three answers: "3071" -> reversal 1703, sorting 0137, running sum 3301
    assert [get_task(n).solve("3071") for n in ("reversal", "sorting", "running_sum")] == ["1703", "0137", "3301"]
    assert task.reward("1703", {"answer": "1703"}) == 1.0 and task.longest_answer(max_len=6) == 6


def test_max_new_tokens_sized_to_the_answers():
    from moe_rl.config import TaskConfig

    length = {"min_len": 48, "max_len": 48}
    assert TaskConfig(name="running_sum", max_new_tokens=None, kwargs=length).max_new_tokens == 49  # and eos
    assert TaskConfig(name="running_sum", max_new_tokens=None).max_new_tokens == 7  # the defaults: up to 6 digits
    TaskConfig(name="running_sum", max_new_tokens=48, kwargs=length).check()
    with pytest.warns(UserWarning, match=r"task.max_new_tokens=8 cannot hold task=running_sum's answers of up to 48"):
        TaskConfig(name="running_sum", kwargs=length).check()
    with pytest.raises(ValueError, match="task.max_new_tokens=null sizes completions"):
        TaskConfig(name="addition", max_new_tokens=None).check()


def test_load_task_deterministic_and_held_out():
    a = load_task("countdown", n_train=300, n_eval=50, seed=7)
    b = load_task("countdown", n_train=300, n_eval=50, seed=7)
    c = load_task("countdown", n_train=300, n_eval=50, seed=8)
    assert set(a) == {"train", "eval"}
    assert (a["train"].num_rows, a["eval"].num_rows) == (300, 50)
    assert a["train"].column_names == ["prompt", "answer", "numbers", "target"]
    assert a["train"].to_list() == b["train"].to_list() and a["eval"].to_list() == b["eval"].to_list()
    assert a["train"]["prompt"] != c["train"]["prompt"] and a["eval"]["prompt"] != c["eval"]["prompt"]
    assert not set(a["train"]["prompt"]) & set(a["eval"]["prompt"])
    assert len(set(a["train"]["prompt"])) == 300 and len(set(a["eval"]["prompt"])) == 50
    # eval does not depend on n_train; a smaller train split is a prefix of a larger one
    d = load_task("countdown", n_train=100, n_eval=50, seed=7)
    assert d["eval"].to_list() == a["eval"].to_list() and d["train"].to_list() == a["train"].to_list()[:100]
    task = get_task("countdown")
    assert score_completions(task, a["eval"]["answer"], a["eval"]) == [1.0] * 50


@pytest.mark.parametrize("name", sorted(TASKS))
def test_load_task_every_task(name):
    ds = load_task(name, n_train=64, n_eval=16, seed=0)
    assert not set(ds["train"]["prompt"]) & set(ds["eval"]["prompt"])
    assert all(p[0] in get_task(name).prefix for p in ds["train"]["prompt"])
    empty = load_task(name, n_train=0, n_eval=0, seed=0)
    assert empty["train"].column_names == ds["train"].column_names


def test_load_task_kwargs_and_errors():
    ds = load_task("reversal", n_train=20, n_eval=5, seed=1, min_len=2, max_len=2)
    assert all(len(p) == 4 for p in ds["train"]["prompt"])
    with pytest.raises(ValueError, match="unique prompts"):  # only 100 two-digit strings exist
        load_task("reversal", n_train=100, n_eval=5, seed=1, min_len=2, max_len=2)
    with pytest.raises(ValueError, match="valid tasks"):
        load_task("nope", n_train=1, n_eval=1, seed=0)


def test_score_completions():
    task = get_task("addition")
    exs = [ADD, {"prompt": "A1+2=", "answer": "3", "a": 1, "b": 2}, ADD]
    assert score_completions(task, ["1025", "4", "x"], exs) == [1.0, 0.0, 0.0]
    assert score_completions(task, ["1025", "4", "x"], exs, partial_credit=0.2) == [1.0, 0.2, 0.0]
    with pytest.raises(ValueError):
        score_completions(task, ["1"], exs)


def test_tokenizer_ids_and_round_trip():
    tok = make_tokenizer()
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    assert (tok.pad_token, tok.bos_token, tok.eos_token) == ("<pad>", "<bos>", "<eos>")
    assert len(tok) == 53 <= 64 and tok.padding_side == "left"
    assert tok("R3071=")["input_ids"] == [44, 7, 4, 11, 5, 20]  # one id per char, no specials
    rng = random.Random(0)
    samples = [ALPHABET, "C3,5,7>22: 3*5+7", " A 1 +  2 = "] + [
        "".join(rng.choice(ALPHABET) for _ in range(rng.randint(1, 30))) for _ in range(50)
    ]
    for task in TASKS.values():
        ex = task.make_example(rng)
        samples.append(ex["prompt"] + ex["answer"])
    for s in samples:
        ids = tok(s)["input_ids"]
        assert len(ids) == len(s) and 3 not in ids  # no <unk>
        assert tok.decode(ids, skip_special_tokens=True) == s
    ids = tok("A1+2=")["input_ids"]
    assert tok.decode([1, *ids, 2, 0, 0], skip_special_tokens=True) == "A1+2="
    assert tok.decode([1, *ids, 2]) == "<bos>A1+2=<eos>"
    with pytest.raises(ValueError, match=r"characters \['a', 'é'\] are outside the character tokenizer's alphabet"):
        tok("R1a=é")  # outside the alphabet: refused, never a silent <unk>
    with pytest.raises(ValueError, match="outside"):
        tok(["R1=", "x"], padding=True)


def test_tokenizer_left_padding_batch():
    batch = make_tokenizer()(["R1=", "A12+3="], padding=True, return_tensors="pt")
    assert batch["input_ids"].tolist() == [[0, 0, 0, 44, 5, 20], [27, 5, 6, 14, 7, 20]]
    assert batch["attention_mask"].tolist() == [[0, 0, 0, 1, 1, 1], [1] * 6]


def test_tokenizer_optional_bos_eos():
    tok = make_tokenizer(add_bos=True, add_eos=True)
    assert tok("R1=")["input_ids"] == [1, 44, 5, 20, 2]
    assert tok("R1=", add_special_tokens=False)["input_ids"] == [44, 5, 20]
    assert make_tokenizer(add_bos=True)("R1=")["input_ids"] == [1, 44, 5, 20]


@pytest.mark.parametrize("add_bos", [False, True])
def test_tokenizer_save_load(tmp_path, add_bos):
    tok = make_tokenizer(add_bos=add_bos)
    tok.save_pretrained(tmp_path)
    loaded = PreTrainedTokenizerFast.from_pretrained(tmp_path)
    s = "C3,5,7>22:3*5+7"
    assert loaded(s)["input_ids"] == tok(s)["input_ids"]
    assert loaded.get_vocab() == tok.get_vocab()
    assert (loaded.pad_token_id, loaded.bos_token_id, loaded.eos_token_id) == (0, 1, 2)
    assert loaded.padding_side == "left"
    assert loaded.decode(loaded(s)["input_ids"], skip_special_tokens=True) == s
    assert loaded(["R1=", "R123="], padding=True)["input_ids"][0][:2] == [0, 0]


def test_built_model_positions_fit_the_longest_prompt_and_completion(tmp_path):
    """A built model keeps its 256 positions unless a prompt, its completion, bos and eos need more."""
    from helpers import tiny_config

    from moe_rl.loop.cold_start import get_cold_start

    def positions(*changes: str) -> int:
        cfg = tiny_config(tmp_path, "cold_start.mode=none", "task.n_train=8", "task.n_eval=4", *changes, cache=tmp_path)
        model, _, _ = get_cold_start(cfg.model, cfg.task, cfg.cold_start)
        return model.config.max_position_embeddings

    assert positions() == 256
    long = ("task.name=running_sum", "task.kwargs.min_len=200", "task.kwargs.max_len=200", "task.max_new_tokens=null")
    assert positions(*long) == 512  # 202 + 201 + 2 = 405


def test_checkpoint_too_short_for_the_length_is_refused(tmp_path):
    from helpers import tiny_config

    from moe_rl.loop.cold_start import get_cold_start
    from moe_rl.models import build_model

    build_model("qwen3_moe", vocab_size=len(make_tokenizer()), max_position_embeddings=64).save_pretrained(tmp_path)
    length = ("task.name=running_sum", "task.kwargs.min_len=48", "task.kwargs.max_len=48", "task.max_new_tokens=null")
    cfg = tiny_config(tmp_path, f"model.checkpoint={tmp_path}", "task.n_train=8", "task.n_eval=4", *length)
    with pytest.raises(ValueError, match=r"need 101 positions, more than the model's max_position_embeddings=64"):
        get_cold_start(cfg.model, cfg.task, cfg.cold_start)


def test_running_sum_length_composes_from_the_command_line():
    """`task=running_sum task.kwargs.min_len=L task.kwargs.max_len=L` sizes task.max_new_tokens to L and eos."""
    from helpers import ROOT
    from hydra import compose, initialize_config_dir
    from hydra.core.config_store import ConfigStore

    from moe_rl.config import TrainConfig, to_train_config, validate

    ConfigStore.instance().store(name="base_config", node=TrainConfig)
    with initialize_config_dir(config_dir=str(ROOT / "experiments" / "conf"), version_base="1.3"):
        cfg = to_train_config(
            compose("config", overrides=["task=running_sum", *(f"task.kwargs.{k}=48" for k in ("min_len", "max_len"))])
        )
    assert validate(cfg).task.max_new_tokens == 49 and cfg.task.kwargs == {"min_len": 48, "max_len": 48}
