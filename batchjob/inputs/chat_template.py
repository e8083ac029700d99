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
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from batchjob.errors import ConfigError, ModelError

_SPECIAL = (
    *("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token"),
    "mask_token",
)  # the special-token variables HF passes to the template (special_tokens_map)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
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
        ``jinja2.TemplateError`` when the template refuses the messages."""
        return _compiled(self.text).render(
            messages=messages,
            tools=None,
            documents=None,
            add_generation_prompt=True,
            **dict(self.variables),
        )


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
