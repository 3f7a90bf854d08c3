"""A checkpoint's chat template, rendered with the semantics of transformers' apply_chat_template.

Templates are untrusted code from a model repository, so they run in Jinja2's
immutable sandbox with the environment transformers builds: trim_blocks and
lstrip_blocks on, loop controls, the `{% generation %}` block, the `tojson` filter
that does not escape HTML, and the globals `raise_exception` and `strftime_now`.
A render sees `messages`, `add_generation_prompt`, `tools`, `documents` and the
special tokens by name (`bos_token`, `eos_token`, ...).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from align.exit_codes import BadInputData
from align.receipts import sha256_bytes


class ChatTemplateError(ValueError):
    """The template refused a conversation (its own `raise_exception`, or a render error)."""


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` renders its body; only masks would need more."""

    tags = frozenset({"generation"})

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationBlock, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def template_hash(source: str | None) -> str | None:
    """sha256 of the template text; None when the checkpoint has no template."""
    return None if source is None else sha256_bytes(source.encode("utf-8"))


class ChatTemplate:
    """A compiled template with the checkpoint's special tokens bound."""

    def __init__(self, source: str, special_tokens: Mapping[str, str], where: str):
        try:
            self._template = _environment().from_string(source)
        except jinja2.exceptions.TemplateError as err:
            raise BadInputData(f"{where}: chat template does not compile ({err})") from err
        self.source = source
        self.hash = template_hash(source)
        self._special_tokens = dict(special_tokens)

    def render(
        self, messages: Sequence[Mapping[str, str]], *, add_generation_prompt: bool = True
    ) -> str:
        """The text transformers' apply_chat_template(tokenize=False) gives for `messages`."""
        try:
            return self._template.render(
                messages=[dict(m) for m in messages],
                tools=None,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **self._special_tokens,
            )
        except Exception as err:  # a template is code: any failure is its refusal of the row
            raise ChatTemplateError(f"{type(err).__name__}: {err}") from err
