"""POST /tokenize, POST /detokenize, GET /tokenizer_info."""

from __future__ import annotations

import json
from typing import Any

from starlette.requests import Request

from vllmpy.entrypoints.openai.errors import OpenAIError
from vllmpy.entrypoints.openai.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
)
from vllmpy.entrypoints.openai.serving_chat import render_chat_prompt
from vllmpy.entrypoints.openai.serving_common import (
    ServerContext,
    check_prompt_bytes,
    parse_body,
    read_body,
)


class TokenizationHandler:
    def __init__(self, ctx: ServerContext) -> None:
        self.ctx = ctx

    def _tokenizer(self) -> Any:
        tok = self.ctx.engine.tokenizer
        if tok is None:
            raise OpenAIError(400, "this server has no tokenizer (--skip-tokenizer-init)")
        return tok

    async def tokenize(self, raw: Request) -> dict[str, Any]:
        tok = self._tokenizer()
        try:
            body = json.loads(await read_body(raw))
        except ValueError:
            body = None  # parse_body below answers with the 400
        if isinstance(body, dict) and "messages" in body:
            chat_req = await parse_body(raw, TokenizeChatRequest)
            self.ctx.check_model(chat_req.model)
            ids = render_chat_prompt(self.ctx, chat_req.template_messages(), chat_req.add_generation_prompt,
                                     chat_req.continue_final_message, None,
                                     chat_req.chat_template_kwargs,
                                     add_special_tokens=chat_req.add_special_tokens)
            return_strs = chat_req.return_token_strs
        else:
            req = await parse_body(raw, TokenizeCompletionRequest)
            self.ctx.check_model(req.model)
            check_prompt_bytes(self.ctx, req.prompt)
            ids = tok.encode(req.prompt, add_special_tokens=req.add_special_tokens)
            return_strs = req.return_token_strs
        return TokenizeResponse(
            count=len(ids), max_model_len=self.ctx.max_model_len, tokens=ids,
            token_strs=tok.convert_ids_to_tokens(ids) if return_strs else None,
        ).model_dump(mode="json")

    async def detokenize(self, raw: Request) -> dict[str, Any]:
        tok = self._tokenizer()
        req = await parse_body(raw, DetokenizeRequest)
        self.ctx.check_model(req.model)
        try:
            text = tok.decode(req.tokens, skip_special_tokens=False)
        except ValueError as e:
            raise OpenAIError(400, str(e), param="tokens") from None
        return DetokenizeResponse(prompt=text).model_dump(mode="json")

    def info(self) -> dict[str, Any]:
        tok = self._tokenizer()
        return {"tokenizer_class": "vllmpy.tokenizer.Tokenizer", "vocab_size": tok.vocab_size,
                "bos_token": tok.bos_token, "eos_token": tok.eos_token,
                "bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id,
                "chat_template": tok.chat_template,
                "model_max_length": self.ctx.max_model_len}
