"""Chat messages rendered into one prompt text.

A checkpoint may ship its own template: ``chat_template.jinja`` in the checkpoint directory, a
Jinja2 template over ``messages`` (a list of ``{"role", "content"}``) and ``add_generation_prompt``
(True), rendered in Jinja2's sandbox (no attribute access to Python internals, no file or module
access). Without one, the plain default below is used: a ``Role: content`` line per message and a
final ``Assistant:`` to complete, which a model trained on prose can continue.
"""

from __future__ import annotations

import os

import jinja2
import jinja2.sandbox

TEMPLATE_FILE = "chat_template.jinja"
DEFAULT_TEMPLATE = (
    "{% for m in messages %}{{ m.role | capitalize }}: {{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)


class ChatTemplate:
    def __init__(self, source: str = DEFAULT_TEMPLATE, origin: str = "the default template"):
        self.origin = origin
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(undefined=jinja2.StrictUndefined, autoescape=False)
        try:
            self.template = env.from_string(source)
        except jinja2.TemplateError as e:
            raise ValueError(f"{origin}: not a valid Jinja2 template: {e}") from None

    @classmethod
    def for_checkpoint(cls, directory: str | None) -> "ChatTemplate":
        path = os.path.join(directory, TEMPLATE_FILE) if directory else None
        if path and os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                return cls(f.read(), origin=path)
        return cls()

    def render(self, messages: list[dict]) -> str:
        try:
            return self.template.render(messages=messages, add_generation_prompt=True)
        except jinja2.TemplateError as e:
            raise ValueError(f"messages: {self.origin} could not render them: {e}") from None
