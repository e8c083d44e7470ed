"""Protocol adapters: each maps its wire protocol into a `TurnRequest` and the turn's events back out.

    chat_completions.py  POST /v1/chat/completions (OpenAI)
    completions.py       POST /v1/completions (OpenAI, legacy)
    responses.py         POST/GET/DELETE /v1/responses (OpenAI Responses, Open Responses spec): bodies, events
    responses_request.py its request and the mapping of input items, tools and formats into a turn
    messages.py          POST /v1/messages, /v1/messages/count_tokens (Anthropic Messages)

Each builds its response bodies and stream events in that one module.
"""
