"""vLLM's `/tokenize` and `/detokenize`: request bodies and answers (no Serve: the caller passes the tokenizer).

    POST /tokenize    {"model", "prompt", "add_special_tokens": false}               -> {"count", "max_model_len",
                      {"model", "messages", "add_generation_prompt": true}             "tokens"}
    POST /detokenize  {"model", "tokens": [ids]}                                     -> {"prompt"}

A chat is tokenized as `/v1/chat/completions` tokenizes it (the model's chat template, ready for the assistant's
turn unless `add_generation_prompt` is false or `continue_final_message` true; a message's tool calls, name and
earlier reasoning, and `chat_template_kwargs`, reach the template); a prompt as `/v1/completions` does, with the
tokenizer's own special tokens (BOS where its setting adds one) unless `add_special_tokens` is false, as vLLM's do.
"""

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, model_validator

from cluster.ingress.errors import bad_request
from cluster.ingress.openai_protocol import ChatMessage, chat_messages
from workers.engine.models import ChatTemplateError, chat_token_ids


class TokenizeRequest(BaseModel):
    """Body of `POST /tokenize`: a prompt or chat messages, not both."""

    model_config = ConfigDict(strict=True, extra="forbid")

    model: StrictStr
    prompt: StrictStr | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: StrictBool = True
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    chat_template_kwargs: dict[StrictStr, Any] | None = None

    @model_validator(mode="after")
    def _prompt_or_messages(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("send either prompt or messages")
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
        return self


class DetokenizeRequest(BaseModel):
    """Body of `POST /detokenize`."""

    model_config = ConfigDict(strict=True, extra="forbid")

    model: StrictStr
    tokens: list[Annotated[StrictInt, Field(ge=0)]]


def tokenize_answer(req: TokenizeRequest, tokenizer, max_model_len: int) -> dict:
    """The answer to `/tokenize`; a 400 for chat messages to a model without a chat template."""
    if req.messages is not None:
        try:
            ids = chat_token_ids(tokenizer, chat_messages(req), None, req.add_generation_prompt,
                                 req.continue_final_message, req.chat_template_kwargs)
        except ChatTemplateError as error:  # none, or it refused these messages
            raise bad_request(str(error), "messages") from None
    else:
        ids = tokenizer(req.prompt, add_special_tokens=req.add_special_tokens)["input_ids"]
    return {"count": len(ids), "max_model_len": max_model_len, "tokens": list(ids)}


def detokenize_answer(req: DetokenizeRequest, tokenizer) -> dict:
    """The answer to `/detokenize`; a 400 for ids past the tokenizer's vocabulary."""
    if any(token >= len(tokenizer) for token in req.tokens):
        raise bad_request(f"tokens must be ids below the vocabulary size {len(tokenizer)}", "tokens")
    return {"prompt": tokenizer.decode(req.tokens)}
