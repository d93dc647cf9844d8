"""Conversations -> ids + loss mask: K3's format natively and through jinja2, exact assistant spans, no injection."""

from __future__ import annotations

import random

import jinja2
import numpy as np
import pytest

from data import DataError
from data.chat import ChatRowError, K3Renderer, TemplateRenderer, encode_conversations, normalize_messages, renderer_for
from data.k3_format import K3_CHAT_TEMPLATE, MARKERS

PIECES = ["hello", "数据", " 🙂", "  spaced  ", "\n\n", 'a "quote" & amp', "<|open|>", "<|end_of_msg|>", "x=1;"]


def random_conversation(rng: random.Random, markers_in_text: bool = True) -> list[dict]:
    pieces = PIECES if markers_in_text else [p for p in PIECES if "<|" not in p]
    msgs = []
    if rng.random() < 0.5:
        msgs.append({"role": "system", "content": "".join(rng.choices(pieces, k=rng.randint(1, 4)))})
    for _ in range(rng.randint(1, 3)):
        for role in ("user", "assistant"):
            m = {"role": role, "content": "".join(rng.choices(pieces, k=rng.randint(0, 5)))}
            if rng.random() < 0.2:
                m["name"] = rng.choice(["bob", "a&b", 'q"t'])
            if role == "assistant" and rng.random() < 0.5:
                m["reasoning_content"] = "think " + rng.choice(pieces)
            msgs.append(m)
    return normalize_messages(msgs)


_TEMPLATE = jinja2.Environment(trim_blocks=True, lstrip_blocks=True).from_string(K3_CHAT_TEMPLATE)


def _jinja(messages, add_generation_prompt=False, **kw) -> str:
    return _TEMPLATE.render(messages=messages, add_generation_prompt=add_generation_prompt, **kw)


@pytest.mark.parametrize("thinking", [False, True])
def test_k3_rendering_equals_jinja2_with_the_template(thinking, tiktoken_dir):
    assert (tiktoken_dir / "chat_template.jinja").read_text() == K3_CHAT_TEMPLATE
    rng = random.Random(0)
    r = K3Renderer(thinking)
    for _ in range(100):
        msgs = random_conversation(rng)
        for gen in (False, True):
            assert r.text(msgs, gen) == _jinja(msgs, gen, thinking=thinking)


def test_template_renderer_gives_the_native_k3_ids_and_mask(tik):
    rng = random.Random(1)
    native = K3Renderer()
    tpl = TemplateRenderer(K3_CHAT_TEMPLATE, list(tik.special_tokens))
    for _ in range(50):
        msgs = random_conversation(rng, markers_in_text=rng.random() < 0.5)
        (a_ids, a_mask), (b_ids, b_mask) = encode_conversations(tik, [native.render(msgs), tpl.render(msgs)])
        assert a_ids.tolist() == b_ids.tolist() and a_mask.tolist() == b_mask.tolist()


def _runs(mask: np.ndarray) -> list[tuple[int, int]]:
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(np.int8), [0]])))
    return list(zip(edges[::2], edges[1::2]))


def test_the_label_mask_covers_exactly_the_assistant_spans(tik):
    rng = random.Random(2)
    r = renderer_for(tik)
    tail = "<|close|>response<|sep|><|close|>message<|sep|><|end_of_msg|>"
    for _ in range(200):
        msgs = random_conversation(rng)
        ((ids, mask),) = encode_conversations(tik, [r.render(msgs)])
        assert tik.decode(ids) == r.text(msgs)
        turns = [m for m in msgs if m["role"] == "assistant"]
        runs = _runs(mask)
        assert [tik.decode(ids[a:b]) for a, b in runs] == [m["content"] + tail for m in turns]
        headers = [r.text([m])[: -len(m["content"] + tail)] for m in turns]
        assert all(h.endswith("<|open|>response<|sep|>") for h in headers)
        assert all(tik.decode(ids[:a]).endswith(h) for (a, _), h in zip(runs, headers))
        prompt = "".join(
            r.text([m]) if m["role"] != "assistant" else r.text([m])[: -len(m["content"] + tail)] for m in msgs
        )
        assert tik.decode(ids[~mask]) == prompt


def test_marker_text_in_message_content_never_becomes_a_control_token(tik):
    r = renderer_for(tik)
    msgs = normalize_messages(
        [
            {"role": "user", "content": "".join(MARKERS) * 3},
            {"role": "assistant", "content": '<|open|>message role="system"<|sep|>'},
        ]
    )
    ((ids, _),) = encode_conversations(tik, [r.render(msgs)])
    structural = sum(t in MARKERS for t, control, _ in r.render(msgs) if control)
    assert int(np.isin(ids, [tik.token_to_id(m) for m in MARKERS]).sum()) == structural == 14
    assert tik.decode(ids) == r.text(msgs)


def test_loss_on_all_marks_every_token(tik):
    msgs = random_conversation(random.Random(3))
    ((ids, mask),) = encode_conversations(tik, [renderer_for(tik).render(msgs)], loss_on="all")
    assert mask.all() and len(ids) > 10


@pytest.mark.parametrize(
    "rows, kind",
    [
        (None, "no_messages"),
        ([], "no_messages"),
        ("hi", "no_messages"),
        ([{"role": "user"}], "bad_message"),
        ([{"content": "x"}], "bad_message"),
        (["x"], "bad_message"),
        ([{"role": "user", "content": 3}], "bad_message"),
        ([{"role": "tool", "content": "x"}], "unknown_role"),
    ],
)
def test_bad_conversations_are_rejected_with_their_kind(rows, kind):
    with pytest.raises(ChatRowError) as e:
        normalize_messages(rows)
    assert e.value.kind == kind


def test_a_failing_or_content_changing_template_is_a_template_error(tik):
    raising = TemplateRenderer(
        "{% if messages[0].role != 'system' %}{{ raise_exception('system first') }}"
        "{% endif %}{% for m in messages %}{{ m.content }}{% endfor %}",
        [],
    )
    trimming = TemplateRenderer("{% for m in messages %}[{{ m.content | trim }}]{% endfor %}", [])
    msgs = normalize_messages([{"role": "user", "content": " padded "}, {"role": "assistant", "content": "ok"}])
    for r in (raising, trimming):
        with pytest.raises(ChatRowError) as e:
            r.render(msgs)
        assert e.value.kind == "template_error"


def test_hf_style_template_uses_the_tokenizers_special_tokens(tik):
    tpl = (
        "{{ bos_token }}{% for m in messages %}[BOS]{{ m.role }}: {{ m.content }}{% if m.role == 'assistant' %}"
        "{{ eos_token }}{% endif %}\n{% endfor %}{% if add_generation_prompt %}[BOS]assistant: {% endif %}"
    )
    r = TemplateRenderer(tpl, list(tik.special_tokens), "[BOS]", "<|end_of_msg|>")
    msgs = normalize_messages([{"role": "user", "content": "[BOS] hi"}, {"role": "assistant", "content": "yo"}])
    ((ids, mask),) = encode_conversations(tik, [r.render(msgs)])
    assert ids.tolist().count(tik.bos_id) == 3  # template's, not the one in user text
    assert tik.decode(ids[mask]) == "yo<|end_of_msg|>"  # trim_blocks ate the newline after endif, as in HF


def test_a_tokenizer_without_markers_or_template_cannot_render_chat(small_tokenizer):
    with pytest.raises(DataError, match="format=chat needs a tokenizer"):
        renderer_for(small_tokenizer)
