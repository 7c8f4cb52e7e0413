"""A stand-in OpenAI engine for router tests: `python -m tests.integration.fake_engine PORT NAME`.

`GET /health` answers 200. `POST /v1/completions` (and chat) waits `first_byte_s` (the request
body's `fake_first_byte_s`, default 0.05 s), then answers: streamed (`"stream": true`) as SSE
events `data: {"engine": NAME, "i": i}` for `max_tokens` tokens then `data: [DONE]`, else one
JSON object naming the engine, echoing the prompt's length and the `Authorization` header it
got. `GET /v1/models` lists one model named NAME (after `MODELS_SLEEP_S`, the third argument,
padded with `MODELS_PAD_BYTES`, the fourth). A prompt of token ids whose first
id is 0 makes it answer 500 (a broken engine).
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import AsyncIterator

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

NAME = sys.argv[2] if len(sys.argv) > 2 else "engine"
MODELS_SLEEP_S = float(sys.argv[3]) if len(sys.argv) > 3 else 0.0
MODELS_PAD_BYTES = int(sys.argv[4]) if len(sys.argv) > 4 else 0


async def health(request: Request) -> Response:
    return Response("ok")


async def completions(request: Request) -> Response:
    body = json.loads(await request.body())
    await asyncio.sleep(float(body.get("fake_first_byte_s", 0.05)))
    prompt = body.get("prompt", [])
    if isinstance(prompt, list) and prompt and prompt[0] == 0:
        return JSONResponse({"error": "broken"}, status_code=500)
    rid = request.headers.get("x-request-id", "")
    if body.get("stream"):

        async def events() -> AsyncIterator[bytes]:
            for i in range(int(body.get("max_tokens", 4))):
                yield f"data: {json.dumps({'engine': NAME, 'i': i, 'rid': rid})}\n\n".encode()
                await asyncio.sleep(0.005)
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")
    auth = request.headers.get("authorization", "")
    return JSONResponse({"engine": NAME, "prompt_len": len(prompt), "rid": rid, "auth": auth})


async def models(request: Request) -> Response:
    auth = request.headers.get("authorization", "")
    await asyncio.sleep(MODELS_SLEEP_S)
    pad = "x" * MODELS_PAD_BYTES
    return JSONResponse({"object": "list", "data": [{"id": NAME}], "auth": auth, "pad": pad})


app = Starlette(
    routes=[
        Route("/health", health),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", completions, methods=["POST"]),
        Route("/v1/models", models),
    ]
)

if __name__ == "__main__":
    print("fake_engine_ready", flush=True)
    uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
