"""training/eval/ in one process: the held-out loss is the model's own CE over the set, whatever the batch split;
an evaluation leaves weights, buffers, RNG and train mode as it found them; multiple choice scores are the summed
log-likelihood of each ending given its context."""

from __future__ import annotations

import json
import math
import os
import random

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from data import DataConfig, SourceConfig, prepare_tokenizer
from model import build_model
from tests.model.micro import exercise_every_path, micro_config
from training.eval.choice import ChoiceTask, Item
from training.eval.forward import EvalContext
from training.eval.loss import evaluate_loss
from training.eval.sets import EvalConfigError, build_loss_set
from training.eval.suite import EvalSuite

T = 32


@pytest.fixture(scope="module")
def tok():
    return prepare_tokenizer(DataConfig())  # the cached embedded-corpus tokenizer


@pytest.fixture(scope="module")
def model(tok):
    torch.manual_seed(0)
    m = build_model(micro_config(vocab_size=tok.vocab_size))
    return exercise_every_path(m).train()


@pytest.fixture(scope="module")
def docs_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("eval") / "docs.jsonl"
    rng = random.Random(0)
    words = [
        "def",
        "return",
        "import",
        "class",
        "self",
        "value",
        "index",
        "data",
        "while",
        "for",
        "in",
        "if",
        "else",
        "None",
        "True",
    ]
    docs = [" ".join(rng.choice(words) for _ in range(rng.randint(5, 60))) for _ in range(40)]
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return path


def _set(docs_file, tok, rows=6):
    spec = {"name": "s", "sources": [SourceConfig(type="jsonl", path=str(docs_file))], "rows": rows}
    return build_loss_set(spec, DataConfig(), tok, T, "all")


def test_heldout_loss_is_the_models_own_ce_over_the_set_for_any_batch_split(model, tok, docs_file):
    s = _set(docs_file, tok)
    model.eval()
    with torch.no_grad():  # reference: one forward per row with labels, the model's mean CE x its count
        total = count = 0.0
        for r in range(s.rows):
            cu = torch.tensor([*s.starts[r], T])
            out = model(s.ids_RT[r : r + 1], labels=s.labels_RT[r : r + 1], cu_seqlens=cu)
            total += float(out.loss) * int(out.num_loss_tokens)
            count += int(out.num_loss_tokens)
    model.train()
    assert count == s.n_targets
    got = [evaluate_loss(EvalContext(model, torch.device("cpu"), batch_rows=b), s) for b in (1, 4)]
    for g in got:
        assert g["loss"] == pytest.approx(total / count, rel=1e-6)
        assert g["ppl"] == pytest.approx(math.exp(total / count), rel=1e-6)
        assert g["bpb"] == pytest.approx(total / math.log(2) / s.n_bytes, rel=1e-6)
    assert got[0]["loss"] == pytest.approx(got[1]["loss"], rel=1e-9)
    assert {"loss_pos/0-4", "loss_pos/4-8", "loss_pos/8-16", "loss_pos/16-32"} <= set(got[0])


def test_an_evaluation_leaves_weights_buffers_rng_and_train_mode_as_it_found_them(model, tok, docs_file):
    cfg = OmegaConf.create(
        {"sets": [{"name": "s", "sources": [{"type": "jsonl", "path": str(docs_file)}], "rows": 4}], "tasks": []}
    )
    suite = EvalSuite(cfg, DataConfig(), tok, T, "all")
    before = {k: v.clone() for k, v in [*model.named_parameters(), *model.named_buffers()]}
    torch.manual_seed(5), np.random.seed(5), random.seed(5)
    suite.run(EvalContext(model, torch.device("cpu")))
    after_rng = (torch.rand(1), np.random.rand(), random.random())
    torch.manual_seed(5), np.random.seed(5), random.seed(5)
    assert after_rng == (torch.rand(1), np.random.rand(), random.random())
    assert model.training
    for k, v in [*model.named_parameters(), *model.named_buffers()]:
        assert torch.equal(v, before[k]), k  # router biases included


def test_a_set_shorter_than_one_row_is_refused_in_one_line(tok, tmp_path):
    path = tmp_path / "short.jsonl"
    path.write_text(json.dumps({"text": "def f(): pass"}) + "\n")
    spec = {"name": "short", "sources": [SourceConfig(type="jsonl", path=str(path))], "rows": 4}
    with pytest.raises(EvalConfigError, match="yields no row of train.seq_len=512"):
        build_loss_set(spec, DataConfig(), tok, 512, "all")
    path.write_text("")
    with pytest.raises(EvalConfigError, match="no usable documents"):
        build_loss_set(spec, DataConfig(), tok, 512, "all")


def test_choice_scores_each_ending_by_its_summed_log_likelihood(model, tok, tmp_path):
    items = [
        Item("def add(a, b):\n    return", ["a + b", "None", "self.value"], 0),
        Item("import os\nimport", ["sys", "data for data in index"], 1),
        Item("while True:", ["break", "pass", "return None", "continue"], 3),
    ]
    path = tmp_path / "mc.jsonl"
    path.write_text(
        "".join(json.dumps({"ctx": i.context, "endings": i.endings, "label": i.label}) + "\n" for i in items)
    )
    task = ChoiceTask("mc", {"type": "choice", "path": str(path)}, tok, 24)
    model.eval()
    want_acc = want_norm = 0
    with torch.no_grad():
        for it in items:
            ll, norm = [], []
            ctx_ids = tok.encode(it.context)
            for e in it.endings:
                whole = tok.encode(it.context + " " + e)
                ids = torch.tensor([whole])
                logp = model(ids).logits[0].double().log_softmax(-1)
                s = sum(float(logp[t - 1, whole[t]]) for t in range(len(ctx_ids), len(whole)))
                ll.append(s), norm.append(s / len(" " + e))
            want_acc += int(np.argmax(ll) == it.label)
            want_norm += int(np.argmax(norm) == it.label)
    got = task.evaluate(EvalContext(model, torch.device("cpu"), batch_rows=2))
    model.train()
    assert got["acc"] == want_acc / 3 and got["acc_norm"] == want_norm / 3


def test_choice_files_with_bad_lines_are_refused_naming_the_line(tmp_path):
    from training.eval.choice import read_jsonl

    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"ctx": "a", "endings": ["b", "c"], "label": 0}) + "\n{not json\n")
    with pytest.raises(EvalConfigError, match=r"bad.jsonl:2 is not valid JSON"):
        read_jsonl(str(path))
    path.write_text(json.dumps({"ctx_a": "A man", "ctx_b": "sits", "endings": ["x", "y"], "label": "1"}) + "\n")
    (item,) = read_jsonl(str(path))
    assert item.context == "A man Sits" and item.label == 1  # HF hellaswag fields, a str label
    path.write_text(json.dumps({"ctx": "a", "endings": ["b", "c"], "label": 2}) + "\n")
    with pytest.raises(EvalConfigError, match="outside endings"):
        read_jsonl(str(path))


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["eval.sets=[{name: x, sources: [{type: jsonl, path: /nonexistent/x.jsonl}]}]"], "does not exist"),
        (["eval.tasks=[{type: nosuch, name: t}]"], "unknown task type 'nosuch'"),
        (["eval=heldout", "data.sources=[{type: embedded}]"], "none holds any out: set data.sources"),
        (["eval.tasks=[{type: choice, name: t, path: /nonexistent/mc.jsonl}]"], "does not exist"),
        (["eval.tasks=[{type: choice, name: t}]"], "give exactly one of path"),
        (["eval=heldout", "eval.tasks=[{type: choice, name: heldout, source: embedded}]"], "repeat"),
    ],
)
def test_bad_eval_config_is_one_line_before_any_process_group(overrides, message):
    from training.checks import TrainConfigError
    from training.config import compose, validate

    with pytest.raises(TrainConfigError, match=message) as e:
        validate(compose(overrides), 1)
    assert "\n" not in str(e.value)


def test_passkey_scores_the_key_tokens_at_each_length_and_depth_and_writes_its_table_and_heatmap(model, tok, tmp_path):
    from data.passkey import document
    from training.eval.passkey import PasskeyTask

    task = PasskeyTask("pk", {"lengths": [96, 128], "depths": [0.0, 1.0], "samples": 1, "digits": 4}, tok, 96)
    ids_RT, labels_RT, _, alen, cells = task.groups[0]
    assert ids_RT.shape == (2, 96) and cells == [0, 1]
    key_ids = labels_RT[0][labels_RT[0] != -100].tolist()
    text = tok.decode(ids_RT[0].tolist())
    key = tok.decode(key_ids).strip()
    assert len(key) == 4 and text.startswith(document(key, 0, 0.0)[:18]) and f"The pass key is {key}." in text
    model.eval()
    got = task.evaluate(EvalContext(model, torch.device("cpu"), batch_rows=1, out_dir=str(tmp_path)))
    with torch.no_grad():  # reference: the key's log-probability from one forward per row
        want = []
        for r in range(2):
            logp = model(ids_RT[r : r + 1]).logits[0].double().log_softmax(-1)
            at = torch.nonzero(labels_RT[r] != -100).squeeze(-1)
            want.append(float(logp[at - 1, ids_RT[r, at]].sum()))
    model.train()
    assert got["logprob@96"] == pytest.approx(sum(want) / 2, rel=1e-6)
    assert set(got) >= {"acc@96", "acc@128", "logprob@128", "acc@96/d0", "acc@96/d100"}
    assert (tmp_path / "passkey" / "pk.png").stat().st_size > 0
    assert "| 128 |" in (tmp_path / "passkey" / "pk.md").read_text()


def test_the_embedded_choice_task_is_the_same_in_every_process():
    import subprocess
    import sys

    from training.eval.choice import embedded_items

    code = (
        "import json; from training.eval.choice import embedded_items; "
        "print(json.dumps([(i.context, i.endings, i.label) for i in embedded_items(16)]))"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}  # str hashing (set order) differs from this process'
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env).stdout
    assert json.loads(other) == [[i.context, i.endings, i.label] for i in embedded_items(16)]


def test_a_choice_dataset_is_read_through_hf_datasets_with_hellaswags_fields(tmp_path):
    """`dataset: <name>` goes to `datasets.load_dataset(name, config, split=...)`; here a local dataset folder (no
    network) with the HF `hellaswag` rows' fields: ctx_a + ctx_b, activity_label, label as a string, read as
    lm-eval-harness reads them (ctx_b capitalised, ` [title]` -> `. `)."""
    from training.eval.choice import load_items

    rows = [
        {
            "ind": 4,
            "activity_label": "Removing ice from car",
            "ctx_a": "Then, the man writes over the snow.",
            "ctx_b": "then",
            "ctx": "Then, the man writes over the snow. then",
            "endings": ["a [title] b", "b", "c", "d"],
            "source_id": "x",
            "split": "val",
            "split_type": "indomain",
            "label": "3",
        },
        {
            "ind": 5,
            "activity_label": "Baking cookies",
            "ctx_a": "A woman mixes flour.",
            "ctx_b": "she",
            "ctx": "A woman mixes flour. she",
            "endings": ["e", "f", "g", "h"],
            "source_id": "y",
            "split": "val",
            "split_type": "zeroshot",
            "label": "0",
        },
    ]
    folder = tmp_path / "hellaswag_local"
    folder.mkdir()
    (folder / "validation.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    items = load_items({"dataset": str(folder), "split": "validation"})
    assert [it.label for it in items] == [3, 0] and items[1].endings == ["e", "f", "g", "h"]
    assert items[0].context == "Removing ice from car: Then, the man writes over the snow. Then"
    assert items[0].endings[0] == "a. b"
