"""One turn of an agent, whatever protocol carried it.

Every generation request (chat completions, completions, Responses, Messages)
is mapped by its adapter (`server/api/`) into a protocol-neutral
`TurnRequest` and runs through the same steps, a module each:

    identity.py      which session the turn belongs to (ids the clients send, stored responses)
    model_choice.py  which served model runs it (`auto`: plan on the large model, execute on the small)
    render.py        messages -> prompt tokens with the chat template; the continuation of a session
    continuation.py  what the session already holds: prefill only what is new (the model's own tokens kept)
    generate.py      the engine bridge: limits, retries while the session's KV moves, disconnects
    tool_calls.py    model output -> text and tool-call events, streamed as they are generated
    park.py          the session parks with the tools it waits on; metrics and traces
    pipeline.py      the steps in order, yielding `TurnEvent`s and a final `TurnResult`

The adapter turns events back into its protocol's chunks and bodies, built in
one module per protocol.
"""
