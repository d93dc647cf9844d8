"""Facts of the released Kimi K3 tokenizer and conversation format, in one place (tokenizer, builder and chat use them).

Learned from public sources (read, not copied):
- pre-tokenisation pattern: Moonshot's `tokenization_kimi.py` (Kimi K2 family; K3 ships the same `tiktoken.model`
  and pattern), as quoted by North-Shore-AI/tiktoken_ex `oracle/kimi_oracle.py` and ml-rust/splintr's `kimi_k3`
  encoding. It gives runs of Han characters their own pre-tokens and subtracts Han from the letter classes.
- special-token layout (ids offset from the base vocabulary of 163,584): splintr's `kimi_k3` table and the
  release's `tokenizer_config.json` as described there; bos `[BOS]` 163584, eos `<|end_of_msg|>` 163586, pad
  `[PAD]` 163839; the other reserved ids are `<|reserved_token_N|>`.
- conversation format ("XTML"): NVIDIA-NeMo/Automodel `components/models/kimi_k3/encoding.py` (a port of the
  release's `encoding_k3.py`): `<|open|>tag attrs<|sep|> ... <|close|>tag<|sep|>`, every message ended by
  `<|end_of_msg|>`; assistant text lives in a `response` channel (and a `think` channel in thinking mode).
  Markers are control tokens; all text and attribute values are ordinary text.
"""

from __future__ import annotations

# Pattern parts of tokenization_kimi.py. `&&` is a character-class intersection: fancy-regex (tiktoken) and the
# `regex` module in V1 mode understand it.
K3_PAT_STR = "|".join(
    [
        r"""[\p{Han}]+""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"""
        r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"""
        r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)

NUM_RESERVED_SPECIAL_TOKENS = 256
K3_BASE_VOCAB = 163_584  # the release: 163,584 BPE ranks + 256 special ids = 163,840

OPEN, CLOSE, SEP, END_OF_MSG = "<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>"
MARKERS = (OPEN, CLOSE, SEP, END_OF_MSG)
BOS, EOS_DOC, PAD, UNK = "[BOS]", "[EOS]", "[PAD]", "[UNK]"

# id - base vocabulary -> name (the named slots of the release; the rest are reserved).
SPECIAL_OFFSETS = {
    0: BOS,
    1: EOS_DOC,
    2: END_OF_MSG,
    3: OPEN,
    4: CLOSE,
    5: SEP,
    6: "[start_header_id]",
    7: "[end_header_id]",
    9: "[EOT]",
    18: "<|media_begin|>",
    19: "<|media_content|>",
    20: "<|media_end|>",
    21: "<|media_pad|>",
    65: "<osagent_mode>",
    254: UNK,
    255: PAD,
}
BOS_TOKEN, EOS_TOKEN, PAD_TOKEN = BOS, END_OF_MSG, PAD  # tokenizer_config.json bos/eos/pad of the release


def reserved_name(token_id: int) -> str:
    return f"<|reserved_token_{token_id}|>"


def special_tokens(num_base: int) -> dict[str, int]:
    """All 256 special tokens after a base vocabulary of `num_base` ranks: named slots + reserved names."""
    return {
        SPECIAL_OFFSETS.get(k, reserved_name(num_base + k)): num_base + k for k in range(NUM_RESERVED_SPECIAL_TOKENS)
    }


# The conversation format as a chat_template.jinja (HF apply_chat_template variables: messages,
# add_generation_prompt; plus `thinking`, default false). Text messages only (system/user/assistant, optional
# `name`; assistant `reasoning_content` in thinking mode). data/chat.py renders the same text natively as
# segments; tests/data check the two agree.
K3_CHAT_TEMPLATE = r"""{#- Kimi K3 conversation format (text messages), written for k3-train from the public
    description of the release's encoding_k3.py. -#}
{%- macro attr(key, value) -%}
{{- ' ' ~ key ~ '="' ~ (value | string | replace('&', '&amp;') | replace('"', '&quot;')) ~ '"' -}}
{%- endmacro -%}
{%- set think = thinking is defined and thinking -%}
{%- for message in messages -%}
{{- '<|open|>message' ~ attr('role', message.role) -}}
{%- if message.name -%}{{- attr('name', message.name) -}}{%- endif -%}
{{- '<|sep|>' -}}
{%- if message.role == 'assistant' -%}
{%- if think -%}
{{- '<|open|>think<|sep|>' -}}
{%- if message.reasoning_content and message.reasoning_content | trim -%}{{- message.reasoning_content -}}{%- endif -%}
{{- '<|close|>think<|sep|>' -}}
{%- endif -%}
{{- '<|open|>response<|sep|>' ~ message.content ~ '<|close|>response<|sep|>' -}}
{%- else -%}
{{- message.content -}}
{%- endif -%}
{{- '<|close|>message<|sep|><|end_of_msg|>' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}
{{- '<|open|>message' ~ attr('role', 'assistant') ~ '<|sep|>' -}}
{{- '<|open|>think<|sep|>' if think else '<|open|>response<|sep|>' -}}
{%- endif -%}
"""
