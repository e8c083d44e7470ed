"""POST /v1/completions: OpenAI's legacy completions over the turn pipeline.

The prompt is text or token ids; with `return_token_ids` (vLLM's extension)
the choice carries the prompt's and the output's token ids, streamed per
chunk, so a harness that resends its history as ids resends exactly what was
generated. `model: "auto"` runs a bare completion on the large model.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from sessionserve.server import protocol as P
from sessionserve.server.api.common import sse, token_logprobs
from sessionserve.server.app import read_json
from sessionserve.server.protocol_common import openapi_route
from sessionserve.server.turn.identity import session_hint
from sessionserve.server.turn.types import StepOutput, TurnRequest, TurnResult

if TYPE_CHECKING:
    from sessionserve.server.turn.pipeline import ActiveTurn, TurnPipeline


def to_turn(request: Request, req: P.CompletionRequest) -> TurnRequest:
    sampling = P.sampling_kwargs(req, default_max_tokens=1)
    sampling.pop("max_tokens")
    logprobs = sampling.pop("logprobs")
    hint = session_hint(request.headers, body_session_id=req.session_id)
    return TurnRequest(protocol="text", model=req.model, prompt=req.prompt, sampling=sampling,
                       max_tokens=req.max_tokens, stream=bool(req.stream), session=hint, priority="interactive",
                       logprobs=logprobs)


def usage(result: TurnResult) -> dict[str, Any]:
    return P.usage_dict(result.num_prompt_tokens, result.num_output_tokens, result.num_cached_tokens)


def register(app: FastAPI, pipeline: TurnPipeline) -> None:
    @app.post("/v1/completions", **openapi_route(P.CompletionRequest))
    async def completions(request: Request) -> Any:
        req = P.parse_completion_request(await read_json(request))
        turn = to_turn(request, req)
        if turn.session.explicit is None:
            turn.session = type(turn.session)()  # only a named session continues a raw completion
        active = await pipeline.start(request, turn)
        cid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        ids = bool(req.return_token_ids)
        want_lp = req.logprobs is not None
        if turn.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(_stream(active, cid, created, include_usage, ids, want_lp),
                                     media_type="text/event-stream")
        result = await active.result()
        out = result.output
        lp = P.completion_logprobs(token_logprobs(active.slot.engine.tokenizer, out)) if want_lp else None
        return JSONResponse(P.completion(cid, created, result.model, out.text, out.finish_reason or "stop",
                                         usage(result), logprobs=lp,
                                         token_ids=list(out.token_ids) if ids else None,
                                         prompt_token_ids=list(out.prompt_token_ids) if ids else None))


async def _stream(active: ActiveTurn, cid: str, created: int, include_usage: bool, ids: bool,
                  want_lp: bool) -> AsyncIterator[str]:
    model = active.model
    tok = active.slot.engine.tokenizer
    offset = 0
    try:
        async for event in active.events():
            if isinstance(event, StepOutput):
                out = event.output
                if not (out.delta_text or out.finished or (ids and out.delta_token_ids)):
                    continue
                lp = None
                if want_lp and out.delta_token_ids:
                    lp = P.completion_logprobs(token_logprobs(tok, out, len(out.delta_token_ids)), offset)
                offset += len(out.delta_text)
                yield sse(P.completion_chunk(cid, created, model, out.delta_text,
                                             (out.finish_reason or "stop") if out.finished else None, logprobs=lp,
                                             token_ids=list(out.delta_token_ids) if ids else None))
            elif isinstance(event, TurnResult) and include_usage:
                yield sse(P.completion_chunk(cid, created, model, None, None, usage=usage(event)))
    except P.OpenAIError as exc:
        yield sse(exc.body())
    yield "data: [DONE]\n\n"
