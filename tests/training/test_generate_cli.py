"""Generation CLI: loads an HF export or a DeepSpeed checkpoint with its tokenizer, streams, reports tokens/s."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from training.tools.generate import main


@pytest.fixture(scope="module")
def hf_export(real_run, tmp_path_factory):
    from training.tools.export import export_checkpoint

    return export_checkpoint(str(real_run), str(tmp_path_factory.mktemp("hf")))


def _run(capsys, *args) -> tuple[int, str, str]:
    rc = main(list(args))
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def test_greedy_stream_is_the_decoded_continuation(hf_export, capsys):
    from data import Tokenizer
    from model import load_hf_checkpoint
    from model.generate import generate

    rc, out, err = _run(capsys, f"checkpoint={hf_export}", "prompt=def add(a, b):", "max_new_tokens=6")
    assert rc == 0 and "tokens/s" in err
    tok = Tokenizer.load(os.path.join(hf_export, "tokenizer.model"))
    model = load_hf_checkpoint(hf_export)
    ids = tok.encode("def add(a, b):")  # the run trained without data.add_bos: no BOS in front
    ref = generate(model, torch.tensor([ids]), 6, eos_token_id=tok.eos_id)[0, len(ids) :].tolist()
    assert out == "def add(a, b):" + tok.decode(ref) + "\n"


def test_deepspeed_checkpoint_and_its_hf_export_sample_the_same_text(real_run, hf_export, capsys):
    args = ("prompt=import os", "max_new_tokens=5", "temperature=0.8", "top_p=0.9", "seed=3")
    rc1, out_ds, _ = _run(capsys, f"checkpoint={real_run}", *args)
    rc2, out_hf, _ = _run(capsys, f"checkpoint={hf_export}", *args)
    assert rc1 == rc2 == 0 and out_ds == out_hf


def test_bench_reports_decode_rate_per_context(hf_export, capsys):
    rc, out, _ = _run(capsys, f"checkpoint={hf_export}", "bench=true", "contexts=8,96", "bench_tokens=4")
    rows = [line.split() for line in out.strip().splitlines()[1:]]
    assert rc == 0 and [r[0] for r in rows] == ["8", "96"] and all(float(r[2]) > 0 for r in rows)


def test_prompt_ids_work_without_a_tokenizer(hf_export, tmp_path, capsys):
    bare = tmp_path / "bare"
    shutil.copytree(hf_export, bare, ignore=shutil.ignore_patterns("tokenizer*"))
    rc, out, _ = _run(capsys, f"checkpoint={bare}", "prompt_ids=1 2 3", "max_new_tokens=3")
    assert rc == 0 and out.startswith("1 2 3") and len(out.split()) == 6
    rc, _, err = _run(capsys, f"checkpoint={bare}", "prompt=hello")
    assert rc == 2 and "use prompt_ids=" in err and len(err.strip().splitlines()) == 1


def test_bos_follows_the_runs_data_config_unless_forced(real_run, hf_export, capsys):
    from training.tools.generate import trained_with_bos

    assert trained_with_bos(real_run / "checkpoints") is False
    _, plain, _ = _run(capsys, f"checkpoint={real_run}", "prompt=import os", "max_new_tokens=4")
    _, forced, _ = _run(capsys, f"checkpoint={real_run}", "prompt=import os", "max_new_tokens=4", "bos=true")
    _, hf, _ = _run(capsys, hf_export, "prompt=import os", "max_new_tokens=4", "bos=false")
    assert plain == hf and plain.startswith("import os") and forced.startswith("import os")


def test_checkpoint_may_be_given_as_the_first_positional_argument(hf_export, capsys):
    rc, out, _ = _run(capsys, hf_export, "prompt_ids=1 2 3", "max_new_tokens=2")
    assert rc == 0 and out.startswith("1 2 3")


@pytest.mark.parametrize(
    "args,fragment",
    [
        ((), "checkpoint=<...> is required"),
        (("checkpoint", "extra"), "is not key=value"),
        (("checkpoint=/nonexistent/x",), "does not exist"),
        (("checkpoint=.", "temprature=1"), "unknown key 'temprature'"),
    ],
)
def test_bad_arguments_are_one_line_errors(args, fragment, capsys):
    rc, _, err = _run(capsys, *args)
    assert rc == 2 and fragment in err and len(err.strip().splitlines()) == 1
