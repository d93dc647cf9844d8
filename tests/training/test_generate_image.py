"""`python -m training.generate ... image=<file>` (issue 23 §6): the picture enters as its placeholder block and the
stream is exactly the library's `generate` with the same pixels; bad combinations fail in one line."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image

from data import DataConfig, SourceConfig
from data.bpe import build_tiktoken_dir
from data.chat import K3Renderer, encode_conversations, normalize_messages
from data.images import ImageRules, prepare_image
from model import K3ForCausalLM, K3ForConditionalGeneration, save_hf_checkpoint
from model.generate import generate
from tests.model.micro import micro_config
from tests.model.vision_micro import micro_vision, randomise
from training.tools.generate import main


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    """A multimodal micro checkpoint (patch-2 tower) with a byte-level K3-layout tokenizer, and a picture."""
    d = tmp_path_factory.mktemp("mm")
    (d / "text.jsonl").write_text("".join(json.dumps({"text": f"the cat {i} sat"}) + "\n" for i in range(20)))
    tok = build_tiktoken_dir(
        d / "tok", 512, DataConfig(sources=[SourceConfig(type="jsonl", path=str(d / "text.jsonl"))])
    )
    cfg = micro_config(
        vocab_size=512, vision_config=micro_vision(), media_placeholder_token_id=tok.token_to_id("<|media_pad|>")
    )
    torch.manual_seed(0)
    model = randomise(K3ForConditionalGeneration(cfg), std=0.2)
    save_hf_checkpoint(model, d / "hf")
    tok.save(d / "hf")
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (8, 12, 3), dtype=np.uint8)).save(d / "pic.png")
    return d, model, tok


def _run(capsys, *args) -> tuple[int, str, str]:
    rc = main(list(args))
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def test_the_stream_is_the_library_generate_with_the_image_before_the_prompt(export, capsys):
    d, model, tok = export
    rc, out, err = _run(
        capsys, f"checkpoint={d / 'hf'}", f"image={d / 'pic.png'}", "prompt=the cat", "max_new_tokens=6"
    )
    assert rc == 0, err
    im = prepare_image(d / "pic.png", ImageRules(patch_size=2, merge=2))
    assert im.size == (12, 8) and im.num_tokens == 6
    ids = [tok.token_to_id("<|media_begin|>"), *tok.encode("image 12x8"), tok.token_to_id("<|media_content|>")]
    ids += [model.media_id] * 6 + [tok.token_to_id("<|media_end|>"), *tok.encode("the cat")]
    want = generate(
        model.eval(),
        torch.tensor([ids]),
        6,
        eos_token_id=tok.eos_id,
        pixel_values=torch.from_numpy(im.pixel_values),
        grid_thws=torch.tensor([im.grid]),
    )[0, len(ids) :].tolist()
    assert out == "the cat" + tok.decode(want) + "\n"
    no_image = generate(model, torch.tensor([tok.encode("the cat")]), 6, eos_token_id=tok.eos_id)[0, 2:].tolist()
    assert want != no_image  # the picture changes what is generated


def test_chat_renders_one_user_turn_with_the_image_and_stops_at_the_responses_close(export, capsys):
    """chat=true: the ids are data/chat.py's rendering of a user turn (image, then prompt) + the assistant's
    opening, as training renders chat rows; the stream is the library's generate on them, ending at <|close|>."""
    d, model, tok = export
    rc, out, err = _run(
        capsys, f"checkpoint={d / 'hf'}", f"image={d / 'pic.png'}", "prompt=the cat", "chat=true", "max_new_tokens=6"
    )
    assert rc == 0, err
    rules = ImageRules(patch_size=2, merge=2)
    parts = [{"type": "image", "image": str(d / "pic.png")}, {"type": "text", "text": "the cat"}]
    msgs = normalize_messages([{"role": "user", "content": parts}], rules)
    ((ids, _),) = encode_conversations(tok, [K3Renderer().render(msgs, add_generation_prompt=True)])
    im = prepare_image(d / "pic.png", rules)
    want = generate(
        model.eval(),
        torch.tensor([ids.tolist()]),
        6,
        eos_token_id=tok.token_to_id("<|close|>"),
        pixel_values=torch.from_numpy(im.pixel_values),
        grid_thws=torch.tensor([im.grid]),
    )[0, len(ids) :].tolist()
    assert out == "the cat" + tok.decode(want) + "\n"


def test_image_on_a_text_checkpoint_or_a_missing_file_is_one_line(export, tmp_path, capsys):
    d, model, tok = export
    save_hf_checkpoint(K3ForCausalLM(model.config.text_only()), tmp_path / "text")
    tok.save(tmp_path / "text")
    rc, _, err = _run(capsys, f"checkpoint={tmp_path / 'text'}", f"image={d / 'pic.png'}", "prompt=hi")
    assert rc == 2 and "needs a multimodal checkpoint" in err and err.count("\n") == 1
    rc, _, err = _run(capsys, f"checkpoint={d / 'hf'}", f"image={tmp_path / 'none.png'}", "prompt=hi")
    assert rc == 2 and "image_missing" in err and err.count("\n") == 1
