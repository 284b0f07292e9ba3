"""Dataset tasks on files and checkpoints made here: rewards, errors, rendering, caches, short runs."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch
from helpers import ROOT
from omegaconf import OmegaConf
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from moe_rl.config import TrainConfig, validate
from moe_rl.loop.cold_start import cold_start_key, data_hash_of, get_cold_start
from moe_rl.models import build_model, load_model
from moe_rl.tasks.dataset import read_rows, render_prompt, split_examples
from moe_rl.tasks.rewards import (
    Scorer,
    TaskInputError,
    exact_reward,
    last_number,
    numeric_reward,
    resolve_reward,
    zero_variance_frac,
)
from moe_rl.tasks.setup import setup_task
from moe_rl.train import Trainer, train

_spec = importlib.util.spec_from_file_location("make_word_problems", ROOT / "examples" / "make_word_problems.py")
make_word_problems = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(make_word_problems)

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "problems.jsonl"
    return make_word_problems.write_jsonl(make_word_problems.word_problems(60, seed=0), path)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, data) -> Path:
    """A saved tiny Qwen3-MoE with its own byte-level BPE tokenizer (trained here) and chat template."""
    root = tmp_path_factory.mktemp("ckpt")
    specials = ["<pad>", "<eos>", "<|system|>", "<|user|>", "<|assistant|>"]
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    texts = [r["question"] + " " + r["answer"] for r in rows] * 3
    backend.train_from_iterator(
        texts,
        trainers.BpeTrainer(
            vocab_size=300, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
        ),
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>", padding_side="left"
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    model = build_model("qwen3_moe", vocab_size=len(tokenizer), seed=0)
    model.config.pad_token_id, model.config.eos_token_id = tokenizer.pad_token_id, tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(root)
    tokenizer.save_pretrained(root)
    return root


def cfg_for(tmp_path: Path, data: Path, checkpoint: Path | None, **changes) -> TrainConfig:
    dotlist = (
        [
            "task.name=dataset",
            f"task.path={data}",
            "task.prompt_field=question",
            "task.answer_field=answer",
            "task.n_train=24",
            "task.n_eval=8",
            "task.max_new_tokens=6",
            "steps=2",
            "eval_every=2",
            "eval_size=4",
            "rollout.prompts_per_step=2",
            "rollout.group_size=2",
            "optim.updates_per_rollout=2",
            "snapshot_every=0",
            "checkpoint_every=0",
            "progress=false",
            "threads=1",
            f"cold_start.cache_dir={tmp_path / 'cache'}",
            "cold_start.max_steps=2",
            "cold_start.eval_every=1",
            "cold_start.batch_size=4",
            "cold_start.band=[0.0,1.0]",
        ]
        + ([f"model.checkpoint={checkpoint}"] if checkpoint else [])
        + [f"{k}={v}" for k, v in changes.items()]
    )
    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(TrainConfig), OmegaConf.from_dotlist(dotlist)))
    cfg.out_dir = str(tmp_path / "run")
    return cfg


# --- rewards ------------------------------------------------------------------------------------


def test_named_rewards_hand_checked():
    gsm = {"answer": "Natalia sold 48/2 = 24 clips in May.\n#### 1,024"}
    assert last_number("so 3 + 4 = 7, and then 1,024.") == 1024.0
    assert numeric_reward("The answer is 1024", gsm) == 1.0
    assert numeric_reward("1,024, or maybe 5", gsm) == 0.0  # the *last* number counts
    assert numeric_reward("1,024", gsm) == 1.0
    assert numeric_reward("1023", gsm) == 0.0 and numeric_reward("no number", gsm) == 0.0
    assert numeric_reward("-3.5", {"answer": "-3.50"}) == 1.0
    assert exact_reward("  42\n", {"answer": "42"}) == 1.0 and exact_reward("42.0", {"answer": "42"}) == 0.0
    math = resolve_reward("math")
    assert math("$\\frac{1}{2}$", {"answer": "0.5"}) == 1.0
    assert math("The answer is $\\boxed{\\frac{3}{4}}$", {"answer": "#### 3/4"}) == 1.0
    assert math("$\\frac{1}{3}$", {"answer": "0.5"}) == 0.0


def test_custom_reward_and_bad_specs(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(
        "def length_bonus(completion, example):\n    return min(len(completion), 10) / 10\n"
        "def one_arg(completion):\n    return 1.0\n"
        "def text_value(completion, example):\n    return 'yes'\n"
        "def flaky(completion, example):\n    if 'x' in completion:\n        raise KeyError('boom')\n    return 1.0\n"
        "NOT_CALLABLE = 3\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert resolve_reward("my_rewards:length_bonus")("abcde", {}) == 0.5
    with pytest.raises(
        ValueError,
        match="no module named 'no_such_module'; the module must be on PYTHONPATH or "
        "importable from the working directory",
    ):
        resolve_reward("no_such_module:f")
    with pytest.raises(ValueError, match="has no callable 'NOT_CALLABLE'"):
        resolve_reward("my_rewards:NOT_CALLABLE")
    with pytest.raises(ValueError, match=r"one_arg\(completion\) cannot be called as \(completion: str, example"):
        resolve_reward("my_rewards:one_arg")
    with pytest.raises(ValueError, match="unknown reward 'fuzzy'; valid: \\['exact', 'math', 'numeric'\\]"):
        resolve_reward("fuzzy")
    scorer = Scorer(resolve_reward("my_rewards:flaky"), "my_rewards:flaky")
    assert [scorer("ok", {}), scorer("x", {}), scorer("x", {}), scorer("fine", {})] == [1.0, 0.0, 0.0, 1.0]
    assert scorer.errors == 2  # raised twice, scored 0 both times, the run goes on
    with pytest.raises(TypeError, match="reward my_rewards:text_value returned 'yes' \\(str\\), not a finite number"):
        Scorer(resolve_reward("my_rewards:text_value"), "my_rewards:text_value")("a", {})


def test_zero_variance_frac():
    assert zero_variance_frac(torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0]), 2) == pytest.approx(2 / 3)
    assert zero_variance_frac(torch.zeros(8), 4) == 1.0


# --- data ---------------------------------------------------------------------------------------


def test_split_is_deterministic_held_out_and_independent_of_n_train(data):
    rows, digest = read_rows(str(data))
    kw = dict(path=str(data), prompt_field="question", answer_field="answer", seed=3)
    train, evals = split_examples(rows, n_train=20, n_eval=8, **kw)
    train2, evals2 = split_examples(rows, n_train=40, n_eval=8, **kw)
    assert evals == evals2 and train2[:20] == train  # eval fixed; a smaller n_train is a prefix
    assert not {e["question"] for e in evals} & {e["question"] for e in train2}
    assert (
        split_examples(
            rows, n_train=20, n_eval=8, path=str(data), prompt_field="question", answer_field="answer", seed=4
        )[1]
        != evals
    )
    assert len(digest) == 64 and read_rows(str(data))[1] == digest


@pytest.mark.parametrize("fmt", ["parquet", "csv", "json"])
def test_other_formats_read_alike(tmp_path, data, fmt):
    rows, _ = read_rows(str(data))
    frame = pd.DataFrame(rows)
    path = tmp_path / f"p.{fmt}"
    {
        "parquet": frame.to_parquet,
        "csv": lambda p: frame.to_csv(p, index=False),
        "json": lambda p: frame.to_json(p, orient="records"),
    }[fmt](path)
    assert read_rows(str(path))[0] == rows


def test_data_errors_name_file_and_field(tmp_path, data):
    rows, _ = read_rows(str(data))
    missing = r"task.prompt_field='prompt' is not a field of .*problems.jsonl.*\['answer', 'question'\]"
    with pytest.raises(ValueError, match=missing):
        split_examples(rows, path=str(data), prompt_field="prompt", answer_field="answer", n_train=4, n_eval=2, seed=0)
    with pytest.raises(
        ValueError,
        match=r"has 60 rows; holding out task.n_eval=8 leaves 52 to train on, and "
        r"task.n_train=58 needs 58",
    ):
        split_examples(
            rows, path=str(data), prompt_field="question", answer_field="answer", n_train=58, n_eval=8, seed=0
        )
    bad = tmp_path / "bad.parquet"
    bad.write_bytes(b"not parquet at all")
    with pytest.raises(ValueError, match="bad.parquet'?: cannot read it as parquet"):
        read_rows(str(bad))
    with pytest.raises(ValueError, match="no such file"):
        read_rows(str(tmp_path / "missing.jsonl"))
    with pytest.raises(ValueError, match=r"unknown file type '.txt'"):
        (tmp_path / "a.txt").write_text("x")
        read_rows(str(tmp_path / "a.txt"))


def test_data_errors_are_one_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a", "answer": "1"}\n\n{"prompt": "b", "answer": "2"}\n{"prompt": "c" "answer": "3"}\n')
    with pytest.raises(TaskInputError) as err:
        read_rows(str(bad))
    assert str(err.value) == (f"task.path={str(bad)!r} line 4: invalid JSON: Expecting ',' delimiter (column 16)")
    (tmp_path / "list.jsonl").write_text('{"prompt": "a"}\n[1, 2]\n')
    with pytest.raises(TaskInputError, match="line 2: a row must be a JSON object, got list"):
        read_rows(str(tmp_path / "list.jsonl"))
    for name, text in (("empty.jsonl", ""), ("blank.jsonl", "\n  \n"), ("empty.csv", "")):
        (tmp_path / name).write_text(text)
        with pytest.raises(TaskInputError) as err:
            read_rows(str(tmp_path / name))
        assert str(err.value) == f"task.path={str(tmp_path / name)!r} is empty"


def test_reward_module_from_the_working_directory(tmp_path, monkeypatch):
    (tmp_path / "cwd_reward_mod.py").write_text("def score(completion, example):\n    return 0.5\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    with pytest.raises(TaskInputError) as err:
        resolve_reward("cwd_reward_mod:score")
    assert str(err.value) == (
        f"reward='cwd_reward_mod:score': no module named 'cwd_reward_mod'; the module must be on "
        f"PYTHONPATH or importable from the working directory ({elsewhere})"
    )
    assert str(elsewhere) not in sys.path  # the failed attempt leaves sys.path as it was
    monkeypatch.chdir(tmp_path)
    assert resolve_reward("cwd_reward_mod:score")("x", {}) == 0.5


def test_all_rows_not_held_out_train(data):
    rows, _ = read_rows(str(data))
    train, evals = split_examples(
        rows, path=str(data), prompt_field="question", answer_field="answer", n_train=None, n_eval=8, seed=0
    )
    assert (len(train), len(evals)) == (52, 8)
    assert not {e["question"] for e in evals} & {e["question"] for e in train}


def test_offline_hub_names_are_clear_errors(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ValueError, match="HF_HUB_OFFLINE is set.*'someone/gsm-nothing'"):
        read_rows("someone/gsm-nothing")
    with pytest.raises(ValueError, match=r"model.checkpoint='someone/moe-nothing'.*HF_HUB_OFFLINE"):
        load_model("someone/moe-nothing")


def test_prompt_rendering(checkpoint):
    from moe_rl.loop.cold_start import load_tokenizer

    tok = load_tokenizer(checkpoint)
    assert (
        render_prompt("2+2?", tok, system_prompt="Be brief.", chat_template="auto")
        == "<|system|>Be brief.\n<|user|>2+2?\n<|assistant|>"
    )
    assert render_prompt("2+2?", tok, system_prompt="Be brief.", chat_template="false") == "Be brief.\n\n2+2?"
    from moe_rl.tasks import make_tokenizer

    assert render_prompt("2+2?", make_tokenizer(), system_prompt=None, chat_template="auto") == "2+2?"
    with pytest.raises(ValueError, match="task.chat_template=true, but the tokenizer has no chat template"):
        render_prompt("2+2?", make_tokenizer(), system_prompt=None, chat_template="true")


def test_config_validation(tmp_path, data):
    cfg = cfg_for(tmp_path, data, None)
    cfg.task.path = None
    with pytest.raises(ValueError, match="task=dataset needs task.path"):
        validate(cfg)
    cfg = cfg_for(tmp_path, data, None, **{"task.chat_template": "maybe"})
    with pytest.raises(ValueError, match="task.chat_template='maybe' is not valid"):
        validate(cfg)


# --- cold start and caches ------------------------------------------------------------------------


def test_cache_key_changes_with_the_data(tmp_path, data):
    copy = tmp_path / "copy.jsonl"
    copy.write_text(data.read_text())
    cfg = cfg_for(tmp_path, copy, None)
    key = cold_start_key(cfg.model, cfg.task, cfg.cold_start, data_hash_of(cfg.task))
    lines = copy.read_text().splitlines()
    row = json.loads(lines[0])
    row["answer"] = row["answer"].replace("####", "#### 1")  # one answer changed, same file name
    copy.write_text("\n".join([json.dumps(row), *lines[1:]]) + "\n")
    assert cold_start_key(cfg.model, cfg.task, cfg.cold_start, data_hash_of(cfg.task)) != key
    cfg.task.system_prompt = "Answer with a number."
    assert cold_start_key(cfg.model, cfg.task, cfg.cold_start, data_hash_of(cfg.task)) != key


def test_tiny_model_gets_a_character_tokenizer_over_the_data(tmp_path, data):
    cfg = cfg_for(tmp_path, data, None)
    model, tok, info = get_cold_start(cfg.model, cfg.task, cfg.cold_start)
    train = setup_task(cfg.task, cfg.cold_start.seed).train
    assert set(info["alphabet"]) >= set("".join(e["question"] + e["answer"] for e in train))
    assert model.config.vocab_size == len(tok) == 4 + len(info["alphabet"])
    assert Path(info["path"], "tokenizer.json").is_file()
    assert tok(train[0]["question"])["input_ids"] and "~" not in info["alphabet"]
    with pytest.raises(ValueError, match=r"characters \['~'\] are outside"):
        tok("what is 2~3?")
    # the cache is reused for the same data and rebuilt for changed data
    again = get_cold_start(cfg.model, cfg.task, cfg.cold_start)[2]
    assert again["path"] == info["path"]


# --- runs ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("reward", ["exact", "numeric", "math", "custom"])
def test_dataset_run_with_checkpoint(tmp_path, data, checkpoint, monkeypatch, reward):
    if reward == "custom":
        (tmp_path / "user_reward.py").write_text(
            "def starts_with_digit(completion, example):\n"
            "    if completion[:1] == '!':\n        raise ValueError('bad')\n"
            "    return float(completion[:1].isdigit())\n"
        )
        monkeypatch.syspath_prepend(str(tmp_path))
        reward = "user_reward:starts_with_digit"
    cfg = cfg_for(tmp_path, data, checkpoint, **{"task.reward": reward, "task.system_prompt": "Solve it."})
    trainer = Trainer(cfg)
    assert trainer.train_examples[0]["prompt"].startswith("<|system|>Solve it.\n<|user|>")
    assert trainer.train_examples[0]["prompt"].endswith("<|assistant|>")
    assert len(trainer.tokenizer) < 400  # the checkpoint's own BPE tokenizer, not the character one
    result = trainer.run()
    assert result["status"] in ("completed", "collapsed", "no_signal")  # 2 steps of an untrained checkpoint
    frame = pd.read_parquet(Path(result["dir"]) / "metrics.parquet")
    keys = set(frame["key"])
    assert {"reward/zero_var_group_frac", "reward/errors", "reward/mean", "task/accuracy"} <= keys
    zero_var = frame[frame.key == "reward/zero_var_group_frac"]["value"]
    assert ((zero_var >= 0) & (zero_var <= 1)).all()


def test_no_signal_is_warned_once_in_log_and_meta(tmp_path, data, checkpoint, monkeypatch, caplog):
    (tmp_path / "zero_reward.py").write_text("def zero(completion, example):\n    return 0.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = cfg_for(tmp_path, data, checkpoint, **{"task.reward": "zero_reward:zero", "steps": 3})
    with caplog.at_level("WARNING"):
        result = train(cfg)
    frame = pd.read_parquet(Path(result["dir"]) / "metrics.parquet")
    assert frame[frame.key == "reward/zero_var_group_frac"]["value"].tolist() == [1.0, 1.0, 1.0]
    meta = json.loads((Path(result["dir"]) / "meta.json").read_text())
    assert len(meta["warnings"]) == 2 and "zero reward variance" in meta["warnings"][0]
    assert meta["warnings"][1].startswith("no_signal: steps 1-3") and result["status"] == "no_signal"
    assert sum("zero reward variance" in r.message for r in caplog.records) == 1


def test_checkpoint_cold_start_sft_and_bfloat16(tmp_path, data, checkpoint):
    cfg = cfg_for(
        tmp_path,
        data,
        checkpoint,
        **{"cold_start.mode": "sft", "task.reward": "numeric", "model.dtype": "bfloat16", "rollout.dtype": "bfloat16"},
    )
    model, tok, info = get_cold_start(cfg.model, cfg.task, cfg.cold_start)
    assert info["steps"] >= 1 and info["tokenizer"] == "checkpoint" and Path(info["path"]).parent == tmp_path / "cache"
    assert next(model.parameters()).dtype == torch.bfloat16
    assert len(tok) == len(load_model_tokenizer(checkpoint))
    result = train(cfg)
    assert result["status"] in ("completed", "collapsed", "no_signal")


def load_model_tokenizer(path):
    from moe_rl.loop.cold_start import load_tokenizer

    return load_tokenizer(path)


def test_any_family_checkpoint_loads_or_is_refused(tmp_path):
    from moe_rl.models.survey import _build
    from moe_rl.models.zoo import moe_families
    from moe_rl.routing import UnsupportedRouterError

    by_type = {f.model_type: f for f in moe_families()}
    _build(by_type["hunyuan_v1_moe"]).save_pretrained(tmp_path / "hunyuan")
    model = load_model(tmp_path / "hunyuan")
    assert type(model).__name__ == "HunYuanMoEV1ForCausalLM"
    _build(by_type["phimoe"]).save_pretrained(tmp_path / "phimoe")
    with pytest.raises(UnsupportedRouterError, match="PhimoeTopKRouter"):
        load_model(tmp_path / "phimoe")


def test_task_kwargs_need_no_plus():
    """`task.prompt_field=...` and `task.kwargs.max_len=...` compose from the command line without `+`
    (Hydra's own composition of experiments/conf, as `experiments/train.py` does it, then validation)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.config_store import ConfigStore

    from moe_rl.config import to_train_config

    ConfigStore.instance().store(name="base_config", node=TrainConfig)
    dataset = ["task=dataset", f"task.path={ROOT / 'examples' / 'word_problems.jsonl'}", "task.prompt_field=question"]
    sorting = ["task=sorting", "task.kwargs.max_len=8", "cold_start=sft"]
    with initialize_config_dir(config_dir=str(ROOT / "experiments" / "conf"), version_base="1.3"):
        a = validate(to_train_config(compose("config", overrides=[*dataset, "task.reward=numeric", "cold_start=none"])))
        b = validate(to_train_config(compose("config", overrides=sorting)))
    assert (a.task.name, a.task.prompt_field, a.task.reward, a.cold_start.mode) == (
        "dataset",
        "question",
        "numeric",
        "none",
    )
    assert (b.task.name, b.task.kwargs["max_len"], b.cold_start.mode) == ("sorting", 8, "sft")


def test_cold_start_stops_in_band_or_on_a_plateau():
    from moe_rl.config import ColdStartConfig, TaskConfig
    from moe_rl.loop.cold_start import cold_start_patience, cold_start_stop

    assert cold_start_stop([0.05, 0.1], 0.2, 3) is None
    assert cold_start_stop([0.05, 0.1, 0.25], 0.2, 3) == "in_band"
    # best 0.15 at the 2nd evaluation; three more without a new best (a tie is no improvement) -> plateau
    assert cold_start_stop([0.1, 0.15, 0.15, 0.12, 0.1], 0.2, 3) == "plateau"
    assert cold_start_stop([0.1, 0.15, 0.15, 0.12], 0.2, 3) is None
    assert cold_start_stop([0.1] * 50, 0.2, 0) is None  # patience 0: never stops early
    assert cold_start_patience(ColdStartConfig(), TaskConfig(name="dataset")) == 10
    assert cold_start_patience(ColdStartConfig(), TaskConfig(name="reversal")) == 0
    assert cold_start_patience(ColdStartConfig(patience=4), TaskConfig(name="reversal")) == 4
