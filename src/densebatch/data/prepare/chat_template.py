"""Chat templates: render a conversation with the tokenizer's own Jinja template (transformers' renderer,
as ``apply_chat_template``), with the loss on each assistant reply placed by position.

For assistant message i of messages m_0 .. m_{n-1}::

    F   = render(m_0 .. m_{n-1})                               the document, byte for byte as apply_chat_template
    P_i = render(m_0 .. m_{i-1}, add_generation_prompt=True)   ends where the reply begins
    E_i = render(m_0 .. m_i)                                   ends where the reply (and its end-of-turn) ends

The reply's loss span is ``F[len(P_i) : len(E_i)]`` without trailing whitespace (the newline between
turns carries no loss, as with the chatml template): lengths of renderings, never a search of the
text for marker strings. This needs P_i and E_i to be prefixes of F: a template that renders a cut
conversation differently from the start of the whole one (one that ends the last message in its own
way, say) is refused for that record, naming the message, rather than given a guessed mask.
"""

from __future__ import annotations

from collections.abc import Sequence

from densebatch.errors import ConfigError

Segment = tuple[str, bool]


class ChatTemplateError(Exception):
    """The template cannot render this conversation, or not as prefixes; ``index`` is the message concerned."""

    def __init__(self, index: int | None, message: str) -> None:
        super().__init__(message)
        self.index, self.message = index, message


class ChatTemplate:
    """A Jinja chat template and the special-token variables (``bos_token``, ``eos_token``, ...) it sees."""

    def __init__(self, template: str, variables: dict[str, str] | None = None) -> None:
        try:
            from transformers.utils.chat_template_utils import render_jinja_template
        except ImportError:
            raise ConfigError(
                "data.template chat_template renders with transformers' chat-template engine: pip install 'densebatch[hf]' "
                "(a recent transformers)"
            ) from None
        self._render = render_jinja_template
        self.template, self.variables = template, dict(variables or {})

    @classmethod
    def of(cls, tok) -> ChatTemplate:
        """The chat template of tokenizer ``tok``; a ``ConfigError`` when it has none."""
        if getattr(tok, "chat_template", None) is None:
            raise ConfigError(
                f"data.template chat_template: the tokenizer {tok.name!r} has no chat template (no chat_template in its "
                "tokenizer_config.json, chat_template.jinja or chat_template.json): set data.tokenizer to a Hugging Face "
                "tokenizer directory that has one, or use data.template: chatml"
            )
        return cls(tok.chat_template, tok.template_variables)

    def render(self, messages: Sequence[dict], add_generation_prompt: bool = False) -> str:
        """The template's text for ``messages``, as ``apply_chat_template(messages, tokenize=False)`` gives it."""
        try:
            rendered, _ = self._render(
                conversations=[list(messages)],
                chat_template=self.template,
                add_generation_prompt=add_generation_prompt,
                **self.variables,
            )
        except Exception as e:  # jinja2 errors and the template's own raise_exception
            raise ChatTemplateError(len(messages) - 1 if messages else None, f"the chat template failed: {e}") from None
        return rendered[0]

    def segments(self, messages: Sequence[dict], loss_on_replies: bool = True) -> list[Segment]:
        """``[(text, carries_loss), ...]`` of the conversation; the texts join to ``render(messages)``."""
        whole = self.render(messages)
        if not loss_on_replies:
            return [(whole, True)]
        spans: list[tuple[int, int]] = []
        for i, m in enumerate(messages):
            if m.get("role") != "assistant":
                continue
            begin = self.render(messages[:i], add_generation_prompt=True)
            end = whole if i == len(messages) - 1 else self.render(messages[: i + 1])
            if not (whole.startswith(end) and end.startswith(begin)) or (spans and len(begin) < spans[-1][1]):
                raise ChatTemplateError(
                    i,
                    "the tokenizer's chat template does not render the conversation cut at this assistant message as a "
                    "prefix of the whole, so its loss cannot be placed by position (use data.template: chatml, or "
                    "data.loss_on: all)",
                )
            reply = whole[len(begin) : len(end)]
            spans.append((len(begin), len(begin) + len(reply.rstrip())))
        out: list[Segment] = []
        pos = 0
        for a, b in spans:
            out += [(whole[pos:a], False), (whole[a:b], True)]
            pos = b
        out.append((whole[pos:], False))
        return [(t, f) for t, f in out if t]
