"""One argument style for every tool: `key=value` pairs (as Hydra overrides are), with leading positionals for
the required keys, `-h` for the tool's docstring, and every bad input as one `error: ...` line and exit 2."""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any

_NONE = ("", "null", "none")


class ToolError(ValueError):
    """Bad command line or input; the message names the problem and the fix."""


def _typed(key: str, raw: str, default: Any, kinds: dict[str, type]) -> Any:
    kind = kinds.get(key, type(default) if default is not None else str)
    if raw.lower() in _NONE and kind is not bool:
        return None
    try:
        if kind is bool:
            if raw.lower() not in ("1", "true", "yes", "0", "false", "no"):
                raise ValueError
            return raw.lower() in ("1", "true", "yes")
        return kind(raw)
    except ValueError:
        raise ToolError(f"{key}={raw!r} must be {kind.__name__}") from None


def parse_args(
    argv: Sequence[str], defaults: dict[str, Any], positional: Sequence[str] = (), kinds: dict[str, type] | None = None
) -> dict[str, Any]:
    """`key=value` arguments typed after `defaults` (or `kinds` where the default is None); the first
    arguments without `=` fill `positional` keys in order. Keys in `positional` are required."""
    args, kinds = dict(defaults), dict(kinds or {})
    free = list(positional)
    for a in argv:
        if "=" not in a:
            if not free:
                raise ToolError(f"argument {a!r} is not key=value; keys: {', '.join(sorted(defaults))}")
            args[free.pop(0)] = a
            continue
        k, v = a.lstrip("+").split("=", 1)
        if k not in defaults:
            raise ToolError(f"unknown key {k!r}; choose from {', '.join(sorted(defaults))}")
        args[k] = _typed(k, v, defaults[k], kinds)
        if k in free:
            free.remove(k)
    missing = [k for k in positional if args.get(k) in (None, "")]
    if missing:
        raise ToolError(f"{missing[0]}=<...> is required (or give it as a positional argument)")
    return args


def run_tool(
    main: Callable[[list[str]], int],
    argv: Sequence[str] | None,
    doc: str,
    errors: tuple[type[BaseException], ...] = (ToolError, FileNotFoundError, ValueError, OSError),
) -> int:
    """Run `main(argv)`; `-h` prints `doc`; an expected error is one line on stderr and exit status 2."""
    args = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in args):
        print(doc)
        return 0
    try:
        return main(args)
    except errors as e:
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        print(f"error: {msg}", file=sys.stderr)
        return 2
