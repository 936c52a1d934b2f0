"""The content of an Anthropic Messages API message (``server/anthropic_protocol.py`` holds the
request around it): text, image, document, tool_use, tool_result and thinking blocks, and ``Message``
itself.

A block this server does not take, or one that is not what its type says, is refused with one
clear error naming the block (``_check_block``), and a block sent by the side of the conversation
that never sends it (an image from the assistant, a tool_use from the user) with one naming the
role. Torch-free, as every request model.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, StrictBool, StrictStr, ValidationError, field_validator, model_validator

from server.protocol import _Request


class TextBlock(_Request):
    type: Literal["text"]
    text: StrictStr

    @field_validator("text")
    @classmethod
    def _non_empty(cls, text: str) -> str:
        # Anthropic refuses an empty text block wherever it is (a message's, a tool result's, the
        # system prompt's); the chat translation would render it as nothing, unsaid.
        if not text:
            raise ValueError("text content blocks must be non-empty")
        return text


class ToolUseBlock(_Request):
    type: Literal["tool_use"]
    id: StrictStr
    name: StrictStr
    input: dict[str, Any] = Field(default_factory=dict)


class ImageSource(_Request):
    """``{"type": "base64", "media_type": "image/png", "data": …}`` or ``{"type": "url", "url": …}``."""

    type: Literal["base64", "url"]
    media_type: StrictStr | None = None
    data: StrictStr | None = None
    url: StrictStr | None = None

    @model_validator(mode="after")
    def _complete(self) -> ImageSource:
        if self.type == "base64" and (self.media_type is None or self.data is None):
            raise ValueError("a base64 image source needs media_type and data")
        if self.type == "url" and not self.url:
            raise ValueError("a url image source needs url")
        return self

    @property
    def chat_url(self) -> str:
        """The image as a chat ``image_url`` URL (a data: URL for base64 data)."""
        if self.type == "url":
            return self.url  # type: ignore[return-value]
        return f"data:{self.media_type};base64,{self.data}"


class ImageBlock(_Request):
    """An image for a vision-language model (a text-only one answers 400)."""

    type: Literal["image"]
    source: ImageSource


# A document's sources this server cannot read: PDFs (base64 data or a URL) and the Files API's
# ids. It has no PDF reader, fetches no URL for a document and stores no files.
_UNREAD_SOURCES = {"base64": "a PDF", "url": "a URL", "file": "a Files API file"}


class DocumentSource(_Request):
    """A text document's source: ``{"type": "text", "media_type": "text/plain", "data": …}`` or
    ``{"type": "content", "content": str | [text blocks]}`` (Anthropic's custom content document,
    each block one chunk). A PDF (``base64``, ``url``) or ``file`` source is refused by its type."""

    type: Literal["text", "content"]
    media_type: Literal["text/plain"] | None = None
    data: StrictStr | None = None
    content: StrictStr | list[TextBlock] | None = None

    @model_validator(mode="before")
    @classmethod
    def _text_only(cls, data: Any) -> Any:
        kind = data.get("type") if isinstance(data, dict) else None
        if kind in _UNREAD_SOURCES:
            raise ValueError(
                f"document source type {kind!r} ({_UNREAD_SOURCES[kind]}) is not supported: this server "
                "reads text documents only (source type 'text' with media_type 'text/plain', or 'content')"
            )
        parts = data.get("content") if isinstance(data, dict) and kind == "content" else None
        for i, part in enumerate(parts if isinstance(parts, list) else ()):
            part_kind = part.get("type") if isinstance(part, dict) else None
            if part_kind != "text":
                raise ValueError(
                    f"content block {i} ({part_kind}) of a content document is not supported: "
                    "this server reads a document's text blocks only"
                )
        return data

    @model_validator(mode="after")
    def _complete(self) -> DocumentSource:
        if self.type == "text" and (self.media_type is None or self.data is None):
            raise ValueError("a text document source needs media_type 'text/plain' and data")
        if self.type == "content" and self.content is None:
            raise ValueError("a content document source needs content")
        return self

    @property
    def text(self) -> str:
        if self.type == "text":
            return self.data or ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(block.text for block in self.content or ())


class Citations(_Request):
    enabled: StrictBool = False


class DocumentBlock(_Request):
    """A text document, shown to the model as text in its place in the user's turn (``text``).

    Rendered as Anthropic's prompting guide lays out documents for its models, which an open model
    reads as plain markup::

        <document>
        <title>TITLE</title>              (when given)
        <context>CONTEXT</context>        (when given)
        <document_content>
        TEXT                              (a content document: its text blocks, one a line)
        </document_content>
        </document>

    vLLM's Messages API takes no document at all (its block types leave it out: a 400). Citations
    (``citations.enabled``) are refused: answering without them would silently drop what the client
    asked for, and this server cannot locate a sentence of its answer in a document."""

    type: Literal["document"]
    source: DocumentSource
    title: StrictStr | None = None
    context: StrictStr | None = None
    citations: Citations | None = None

    @field_validator("citations")
    @classmethod
    def _no_citations(cls, citations: Citations | None) -> Citations | None:
        if citations is not None and citations.enabled:
            raise ValueError(
                "citations are not supported by this server: send the document without "
                "citations.enabled (its text is read all the same)"
            )
        return citations

    @property
    def text(self) -> str:
        lines = ["<document>"]
        if self.title:
            lines.append(f"<title>{self.title}</title>")
        if self.context:
            lines.append(f"<context>{self.context}</context>")
        lines += ["<document_content>", self.source.text, "</document_content>", "</document>"]
        return "\n".join(lines)


class ToolResultBlock(_Request):
    """A tool's answer: text, or text, image and document blocks (images reach the model after
    the tool messages, in the user's turn, as OpenAI's tool messages take text only; a document is
    its rendered text, ``DocumentBlock.text``)."""

    type: Literal["tool_result"]
    tool_use_id: StrictStr
    content: StrictStr | list[TextBlock | ImageBlock | DocumentBlock] = ""
    is_error: StrictBool = False

    @property
    def text(self) -> str:
        """The ``tool`` message's content. A chat tool message has no error flag, so a failed
        call's result says so in its text (``Error: …``), as OpenAI ⇄ Anthropic adapters write it."""
        if isinstance(self.content, str):
            text = self.content
        else:  # text blocks joined as they are; a document on lines of its own
            text, after_document = "", False
            for part in self.content:
                if isinstance(part, ImageBlock):
                    continue
                document = isinstance(part, DocumentBlock)
                if text and (document or after_document):
                    text += "\n"
                text, after_document = text + part.text, document
        if not self.is_error:
            return text
        return f"Error: {text}" if text else "Error"

    @property
    def images(self) -> list[ImageBlock]:
        return [] if isinstance(self.content, str) else [p for p in self.content if isinstance(p, ImageBlock)]


class ThinkingBlock(_Request):
    """An assistant turn's earlier thinking, sent back by clients that keep it: a ``thinking``
    block's text is the turn's ``reasoning_content`` (the chat template renders it, as vLLM passes
    it); a ``redacted_thinking`` block (encrypted ``data``, Anthropic's) has no text and is dropped."""

    type: Literal["thinking", "redacted_thinking"]
    thinking: StrictStr = ""
    signature: StrictStr | None = None


ContentBlock = TextBlock | ImageBlock | DocumentBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock
_BLOCKS: dict[str, type[_Request]] = {
    "text": TextBlock,
    "image": ImageBlock,
    "document": DocumentBlock,
    "tool_use": ToolUseBlock,
    "tool_result": ToolResultBlock,
    "thinking": ThinkingBlock,
    "redacted_thinking": ThinkingBlock,
}
_RESULT_PARTS: dict[str, type[_Request]] = {"text": TextBlock, "image": ImageBlock, "document": DocumentBlock}
_SYSTEM_BLOCKS: dict[str, type[_Request]] = {"text": TextBlock}
# pydantic's names for the members of a union in an error's location: nothing a client sent.
_UNION_TAGS = ("str", "list", "dict", "none")
# The blocks only one side of the conversation sends: the assistant calls tools, the user answers
# them and shows images. Anthropic refuses each on the other side ("'image' blocks are not
# permitted within assistant turns"); the chat translation would drop it unsaid.
_ROLE_OF_BLOCK = {"tool_use": "assistant", "tool_result": "user", "image": "user", "document": "user"}


def _check_block(block: Any, models: dict[str, type[_Request]], what: str, index: int) -> None:
    """One clear error for a block this server does not take (search results, server tools'…) or one
    that is not what its type says: pydantic alone reports a bad block against every member of the
    content's union ("Input should be a valid string (and 9 more error(s))")."""
    kind = block.get("type") if isinstance(block, dict) else None
    model = models.get(kind) if isinstance(kind, str) else None
    if model is None:
        raise ValueError(f"{what} type {kind!r} is not supported")
    parts = block.get("content") if kind == "tool_result" else None
    for i, part in enumerate(parts if isinstance(parts, list) else ()):
        _check_block(part, _RESULT_PARTS, "tool_result content block", i)
    try:
        model.model_validate(block)
    except ValidationError as e:
        first = e.errors()[0]
        field = ".".join(
            str(p) for p in first["loc"] if not (isinstance(p, str) and ("[" in p or p in _UNION_TAGS))
        )
        message = first["msg"].removeprefix("Value error, ")
        where = f"{what} {index} ({kind})"
        raise ValueError(f"{where}: " + (f"'{field}': {message}" if field else message)) from None


class Message(_Request):
    role: Literal["user", "assistant"]
    content: StrictStr | list[ContentBlock]

    @model_validator(mode="before")
    @classmethod
    def _known_blocks(cls, data: Any) -> Any:
        if isinstance(data, dict) and isinstance(data.get("content"), list):
            for i, block in enumerate(data["content"]):
                _check_block(block, _BLOCKS, "content block", i)
        return data

    @model_validator(mode="after")
    def _blocks_of_its_role(self) -> Message:
        for i, block in enumerate(self.content if isinstance(self.content, list) else ()):
            role = _ROLE_OF_BLOCK.get(block.type)
            if role is not None and role != self.role:
                article = "an" if block.type[0] in "aeiou" else "a"
                raise ValueError(
                    f"content block {i} ({block.type}): {article} {block.type} block may appear only "
                    f"in the {role}'s messages"
                )
        return self


def _blocks(message: Message) -> list[ContentBlock]:
    return message.content if isinstance(message.content, list) else []
