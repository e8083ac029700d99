"""Chat templates rendered as Hugging Face ``apply_chat_template`` renders them.

The template comes from ``model.chat_template``: ``auto`` (or unset) reads the model
folder's own (``chat_template.jinja``, else ``tokenizer_config.json`` "chat_template"),
``none`` turns chat off, anything else is a file holding a Jinja template. Rendering
follows ``transformers.utils.chat_template_utils``: an ``ImmutableSandboxedEnvironment``
with trim_blocks/lstrip_blocks and loopcontrols, ``raise_exception`` / ``strftime_now``
globals, a ``tojson`` filter that does not escape HTML, the special tokens of
tokenizer_config.json (``bos_token``, ``eos_token``, ...) as variables, and
``add_generation_prompt=True``. The rendered text already holds any BOS the template
writes, so it is tokenized with ``add_special_tokens=False`` (as HF does).

The template is code a model folder (or the user) brings, run once per row, so each render
is bounded by ``batchjob.guard``'s limits: at most ``MAX_RENDER_SECONDS`` of time (checked
at every loop iteration, macro call and function call) and ``MAX_RENDER_CHARS`` characters
in the output and in any string or list the template builds (``'x' * 10**10``, ``s ~ s``,
``'%99999999999s' % x``, ``center(10**10)``, ``join`` ... are refused before they
allocate). An overrun raises ``RenderLimitError`` (a ``jinja2.TemplateError`` and a
``guard.LimitError``): the row is rejected with status ``chat_template_error`` and the job
goes on.
"""

from __future__ import annotations

import functools
import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2 import nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.visitor import NodeTransformer

from batchjob import guard
from batchjob.errors import ConfigError, ModelError

_SPECIAL = (
    *("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token"),
    "mask_token",
)  # the special-token variables HF passes to the template (special_tokens_map)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    if isinstance(indent, int | str):
        _too_big(indent if isinstance(indent, int) else len(indent), "tojson's indent")
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


# ---------------------------------------------------------------------------------------
# resource bounds per render

MAX_RENDER_SECONDS = guard.MAX_SECONDS  # one row's render (a real one: well under 1 ms)
MAX_RENDER_CHARS = guard.MAX_CHARS  # output, and any string or list built on the way


class RenderLimitError(guard.LimitError, jinja2.exceptions.TemplateError):
    """A render went past MAX_RENDER_SECONDS or MAX_RENDER_CHARS (batchjob.guard's limits)."""


_TICK = "__batchjob_tick"  # the names the guard adds to a template's code
_CONCAT = "__batchjob_concat"


def _tick() -> str:
    if guard.overrun("the render") is not None:
        raise RenderLimitError(
            f"the render took more than {MAX_RENDER_SECONDS:g} s (the limit per row)"
        )
    return ""


def _too_big(n: float, what: str) -> None:
    try:
        guard.check_size(n, what)
    except guard.LimitError as e:
        raise RenderLimitError(str(e)) from None


def _size(x: Any) -> int:
    """Characters of a string, items (and the characters of string items) of a list."""
    if isinstance(x, str | bytes):
        return len(x)
    if isinstance(x, list | tuple):
        return len(x) + sum(len(i) for i in x if isinstance(i, str | bytes))
    return 0


def _concat(*parts: Any) -> str:
    """``a ~ b`` with its length checked before it is built."""
    texts = [p if isinstance(p, str) else str(p) for p in parts]
    _too_big(sum(map(len, texts)), "a string joined with ~")
    return "".join(texts)


_WIDTH = re.compile(r"%[-+ #0]*(\d+)?(?:\.(\d+))?|\{[^{}]*?:[^{}]*?(\d+)(?:\.(\d+))?[^{}]*?\}")


def _check_format(fmt: Any) -> None:
    """A %- or {}-format whose width or precision alone passes the limit."""
    if isinstance(fmt, str):
        for m in _WIDTH.finditer(fmt):
            _too_big(max((int(g) for g in m.groups() if g), default=0), "a formatted field")


def _check_text_op(name: str, text: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Refuse a string method / filter whose result would pass the limit, before it runs."""
    if not isinstance(text, str):
        return
    arg = args[0] if args else next(iter(kwargs.values()), None)
    if name in ("center", "ljust", "rjust", "zfill") and isinstance(arg, int):
        _too_big(arg, f"{name}()")
    elif name == "expandtabs" and isinstance(arg, int):
        _too_big(len(text) * max(arg, 1), "expandtabs()")
    elif name == "indent":
        width = len(arg) if isinstance(arg, str) else arg if isinstance(arg, int) else 4
        _too_big(len(text) + (text.count("\n") + 1) * width, "indent()")
    elif name == "replace" and len(args) >= 2 and isinstance(args[1], str):
        old, new = str(args[0]), args[1]
        count = text.count(old) if old else len(text) + 1
        _too_big(len(text) + count * max(len(new) - len(old), 0), "replace()")
    elif name in ("format", "format_map") or name == "%":
        _check_format(text)
    elif name == "wordwrap":
        wrap = kwargs.get("wrapstring", args[2] if len(args) > 2 else None)
        width = arg if isinstance(arg, int) and arg > 0 else 79
        if isinstance(wrap, str):
            _too_big(len(text) + (len(text) // width + 1) * len(wrap), "wordwrap()")


def _guard_join(sep: str, items: Any) -> list[str]:
    texts = [i if isinstance(i, str) else str(i) for i in items]
    _too_big(sum(map(len, texts)) + len(sep) * max(len(texts) - 1, 0), "join()")
    return texts


def _guarded_filter(name: str, f: Callable[..., Any]) -> Callable[..., Any]:
    """A filter with its result bounded (checked before it runs where it can grow)."""
    passes_ctx = getattr(f, "jinja_pass_arg", None) is not None

    @functools.wraps(f)
    def run(*args: Any, **kwargs: Any) -> Any:
        _tick()
        ctx, rest = (args[:1], args[1:]) if passes_ctx else ((), args)
        if name == "join" and rest:
            sep = rest[1] if len(rest) > 1 else kwargs.get("d", "")
            if len(rest) < 3 and "attribute" not in kwargs and isinstance(sep, str):
                rest = (_guard_join(sep, rest[0]), *rest[1:])
        elif rest:
            _check_text_op(name, rest[0], rest[1:], kwargs)
        out = f(*ctx, *rest, **kwargs)
        _too_big(_size(out), f"the result of |{name}")
        return out

    return run


class _Guard(NodeTransformer):
    """Adds a deadline check at the top of every loop body, macro and call block, and turns
    ``~`` into a length-checked concatenation."""

    def _ticked(self, node: Any) -> Any:
        self.generic_visit(node)
        tick = nodes.ExprStmt(nodes.Call(nodes.Name(_TICK, "load"), [], [], None, None))
        node.body.insert(0, tick)
        return node

    visit_For = visit_Macro = visit_CallBlock = _ticked

    def visit_Concat(self, node: nodes.Concat) -> nodes.Call:
        self.generic_visit(node)
        return nodes.Call(nodes.Name(_CONCAT, "load"), node.nodes, [], None, None)


class _BoundedEnvironment(ImmutableSandboxedEnvironment):
    """HF's sandbox, with MAX_RENDER_SECONDS / MAX_RENDER_CHARS enforced (module docstring)."""

    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def _parse(self, source: str, name: str | None, filename: str | None) -> nodes.Template:
        tree = _Guard().visit(super()._parse(source, name, filename))
        assert isinstance(tree, nodes.Template)
        return tree

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        _tick()
        if operator == "*":
            seq, n = (left, right) if isinstance(right, int) else (right, left)
            if isinstance(seq, str | bytes | list | tuple) and isinstance(n, int):
                _too_big(_size(seq) * max(n, 0), "a repeated string or list")
        elif operator == "+" and _size(left) and _size(right):
            _too_big(_size(left) + _size(right), "a string or list built with +")
        elif operator == "**" and isinstance(left, int) and isinstance(right, int):
            if abs(left) > 1 and right > 0:
                _too_big(right * math.log2(abs(left)) / 8, "a number's bytes")
        elif operator == "%":
            _check_text_op("%", left, (), {})
        return super().call_binop(context, operator, left, right)

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:
        _tick()
        owner = getattr(__obj, "__self__", None)
        if isinstance(owner, str):
            name = getattr(__obj, "__name__", "")
            if name == "join" and args:
                args = (_guard_join(owner, args[0]), *args[1:])
            else:
                _check_text_op(name, owner, args, kwargs)
        out = super().call(__context, __obj, *args, **kwargs)
        _too_big(_size(out), "a call's result")
        return out


def _environment() -> ImmutableSandboxedEnvironment:
    env = _BoundedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    for name in ("center", "indent", "replace", "join", "format", "wordwrap", "tojson"):
        env.filters[name] = _guarded_filter(name, env.filters[name])
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals[_TICK] = _tick
    env.globals[_CONCAT] = _concat
    return env


def _token_str(v: object) -> str | None:
    if isinstance(v, dict):  # AddedToken serialised as {"content": ...}
        v = v.get("content")
    return v if isinstance(v, str) else None


@dataclass(frozen=True)
class ChatTemplate:
    """A compiled chat template and the variables HF passes beside the messages."""

    source: str  # where it came from (for messages)
    text: str
    variables: tuple[tuple[str, str], ...]  # (bos_token, "<s>"), ...

    def render(self, messages: list[dict[str, Any]]) -> str:
        """One conversation -> prompt text ending in the assistant's turn opener.
        ``jinja2.TemplateError`` when the template refuses the messages, ``RenderLimitError``
        when it runs past MAX_RENDER_SECONDS or MAX_RENDER_CHARS."""
        template = _compiled(self.text)
        with guard.deadline(MAX_RENDER_SECONDS):
            chunks, size = [], 0
            for chunk in template.generate(
                messages=messages,
                tools=None,
                documents=None,
                add_generation_prompt=True,
                **dict(self.variables),
            ):
                size += len(chunk)
                _too_big(size, "the rendered prompt")
                chunks.append(chunk)
            return "".join(chunks)


_CACHE: dict[str, jinja2.Template] = {}


def _compiled(text: str) -> jinja2.Template:
    if text not in _CACHE:
        _CACHE[text] = _environment().from_string(text)
    return _CACHE[text]


def _folder_template(folder: Path, cfg: dict) -> tuple[str, str] | None:
    """(source, text) of the folder's own template; chat_template.jinja wins (as in HF)."""
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        return str(jinja_file), jinja_file.read_text()
    t = cfg.get("chat_template")
    if isinstance(t, list):  # named templates: [{"name": "default", "template": ...}]
        named = {d.get("name"): d.get("template") for d in t if isinstance(d, dict)}
        t = named.get("default")
    if isinstance(t, str) and t:
        return f"{folder / 'tokenizer_config.json'} (chat_template)", t
    return None


def load_chat_template(model_path: Path | str | None, setting: str | None) -> ChatTemplate | None:
    """The job's chat template (None: no template to use). Errors name model.chat_template."""
    if setting == "none":
        return None
    folder = Path(model_path) if model_path is not None else None
    cfg: dict = {}
    if folder is not None and (folder / "tokenizer_config.json").is_file():
        try:
            cfg = json.loads((folder / "tokenizer_config.json").read_text())
        except ValueError as e:
            raise ModelError(f"{folder / 'tokenizer_config.json'}: invalid JSON: {e}") from None
    if setting in (None, "auto"):
        found = _folder_template(folder, cfg) if folder is not None else None
        if found is None:
            return None
        source, text = found
    else:
        path = Path(setting)
        if not path.is_file():
            raise ConfigError(
                f"model.chat_template: {setting!r} is not auto, none or a template file"
            )
        source, text = str(path), path.read_text()
    try:
        _compiled(text)
    except jinja2.TemplateSyntaxError as e:
        raise ConfigError(
            f"model.chat_template: {source}: invalid Jinja template: {e} (line {e.lineno})"
        ) from None
    variables = tuple((k, s) for k in _SPECIAL if (s := _token_str(cfg.get(k))) is not None)
    return ChatTemplate(source, text, variables)


def missing_template(model_path: Path | str | None) -> ModelError:
    """The error for chat input on a model folder without a template."""
    return ModelError(
        f"model.chat_template: the model folder {model_path} has no chat template "
        "(chat_template.jinja or tokenizer_config.json 'chat_template'); chat input "
        "(input.messages_column, input.system_prompt, chat requests) needs one: "
        "set model.chat_template = PATH to a Jinja template"
    )
