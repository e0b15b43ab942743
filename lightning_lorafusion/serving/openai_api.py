"""The OpenAI API <-> engine translation the server uses, in one namespace: requests and their
validation (``openai_schemas``) and responses and stream chunks (``openai_responses``)."""

from __future__ import annotations

from .openai_responses import (
    chat_choice, chat_chunk, chat_logprobs, chat_response, ChoiceOutput, ChunkWriter, completion_choice,
    completion_chunk, completion_logprobs, completion_response, model_card, models_list, new_id, now, sse, SSE_DONE,
    stream_event_logprobs, token_text, usage, usage_chunk)
from .openai_schemas import (
    APIError, chat_prompt, ChatCompletionRequest, ChatMessage, check_token_ids, completion_prompts,
    CompletionRequest, DetokenizeRequest, error_body, INT64, MAX_INT32, MAX_LOGIT_BIAS, MAX_STOP_SEQUENCES,
    MAX_TOP_LOGPROBS, model_not_found, parse_request, Prompt, resolve_max_tokens, sampling_kwargs, StreamOptions,
    text_token_ids, TokenId, tokenizer_info, TokenizeRequest)

__all__ = [
    "APIError", "chat_choice", "chat_chunk", "chat_logprobs", "chat_prompt", "chat_response",
    "ChatCompletionRequest", "ChatMessage", "check_token_ids", "ChoiceOutput", "ChunkWriter", "completion_choice",
    "completion_chunk", "completion_logprobs", "completion_prompts", "completion_response", "CompletionRequest",
    "DetokenizeRequest", "error_body", "INT64", "MAX_INT32", "MAX_LOGIT_BIAS", "MAX_STOP_SEQUENCES",
    "MAX_TOP_LOGPROBS", "model_card", "model_not_found", "models_list", "new_id", "now", "parse_request", "Prompt",
    "resolve_max_tokens", "sampling_kwargs", "sse", "SSE_DONE", "stream_event_logprobs", "StreamOptions",
    "text_token_ids", "token_text", "TokenId", "tokenizer_info", "TokenizeRequest", "usage", "usage_chunk"]
