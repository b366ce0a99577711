"""``/v1/embeddings``: the embedding model's vectors of texts or of arrays of its token ids, in
OpenAI's shape; any model name, or none, reaches it unless names are strict (as ``check_model``
for chat)."""

from __future__ import annotations

import base64

import numpy as np
from anyio import to_thread
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from chatkv.server.errors import APIError, from_chatkv
from chatkv.server.routes import _short, read_request
from chatkv.server.schemas import parse_embedding


async def embeddings(request: Request) -> Response:
    state = request.app.state.chatkv
    req = parse_embedding((await read_request(request))[1])
    slot = state.limit.acquire()
    try:
        embedder = await to_thread.run_sync(state.get_embedder)
        # as check_model for chat: any name, or none, reaches the one embedding model unless
        # names are strict (clients send their own, e.g. text-embedding-3-small)
        if state.strict_model_names and req.model is None:
            raise APIError(400, "you must provide a model parameter", "missing_parameter", "model")
        if state.strict_model_names and req.model not in state.embedding_names | {embedder.model_id}:
            raise APIError(
                404,
                f"The model {_short(req.model)} does not exist (embeddings: {state.embedding_name!r}).",
                "model_not_found",
                "model",
            )
        if req.dimensions is not None and req.dimensions != embedder.dim:
            raise APIError(
                400,
                f"dimensions must be the model's own ({embedder.dim}), got {req.dimensions}",
                "unsupported_parameter",
                "dimensions",
            )
        try:
            vectors, tokens = await to_thread.run_sync(
                lambda: (
                    (embedder.encode_ids(req.inputs), sum(len(t) for t in req.inputs))
                    if req.token_ids
                    else (embedder.encode(req.inputs), sum(embedder.count_tokens(t) for t in req.inputs))
                )
            )
        except Exception as e:  # noqa: BLE001
            error = from_chatkv(e)
            if error.status == 400 and error.param is None:
                error.param = "input"  # what the embedder refuses is in the input (an id, a text)
            raise error from e
    finally:
        slot.release()
    data = []
    for i, v in enumerate(np.asarray(vectors, dtype=np.float32)):
        emb = base64.b64encode(v.astype("<f4").tobytes()).decode() if req.encoding_format == "base64" else v.tolist()
        data.append({"object": "embedding", "index": i, "embedding": emb})
    return JSONResponse(
        {
            "object": "list",
            "data": data,
            "model": state.embedding_name,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }
    )
