"""A trainer's side of vLLM's online RL routes, as a plain HTTP client (httpx), recording every exchange.

    client = RLClient(server.url, server.model)
    client.push({"path": "/ckpt/draftB"}, weight_version="step-1")  # pause, start_draft, update, finish, resume
    client.complete(PROMPTS)                                          # greedy token ids per prompt
    client.rpc("lifecycle_states")                                    # /collective_rpc (dev): one answer per worker

The routes (vllm/entrypoints/rl/online/api_router.py, mounted with `VLLM_SERVER_DEV_MODE=1`): `/pause?mode=
abort|wait|keep`, `/resume`, `/is_paused`, `/start_weight_update` (the target: a policy sync),
`/start_draft_weight_update`, `/update_weights` `{"update_info": {...}}`, `/finish_weight_update`
`{"weight_version": ...}`, `/weight_info`, `/weight_checker` `{"action": "checksum"|"compare"|"reset"}`.

A connection the server closed after answering (uvicorn does so after an exception reached Starlette's
ServerErrorMiddleware: vLLM's generic 500s) makes the NEXT request on the pooled connection fail with a reset;
the client counts it in `resets`, records it, and sends the request again on a new connection (it never reached
the server's application).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["PROMPTS", "Exchange", "RLClient"]

#: token-id prompts (the server runs with --skip-tokenizer-init)
PROMPTS: list[list[int]] = [[1, 5, 7, 9, 11], [3, 3, 3, 3], [200, 17, 44, 90, 91, 92, 93], [0, 1, 2, 3, 4, 5, 6, 7, 8]]


@dataclass
class Exchange:
    """One request and its answer."""

    method: str
    path: str
    body: Any
    status: int  # -1: the connection was reset before an answer
    answer: Any  # the JSON answer, or the text when it is not JSON
    ms: float

    @property
    def ok(self) -> bool:
        return self.status == 200

    @property
    def message(self) -> str:
        """vLLM's error message (`{"error": {"message": ...}}`), or the answer as text."""
        if isinstance(self.answer, dict):
            err = self.answer.get("error")
            if isinstance(err, dict) and "message" in err:
                return str(err["message"])
            if "detail" in self.answer:
                return str(self.answer["detail"])
        return str(self.answer)

    def __str__(self) -> str:
        return f"{self.method} {self.path} -> {self.status} ({self.ms:.0f} ms): {str(self.answer)[:600]}"


@dataclass
class RLClient:
    """A trainer driving a server's RL routes over HTTP (one pooled connection, as httpx keeps it)."""

    url: str
    model: str
    timeout_s: float = 120.0
    log: list[Exchange] = field(default_factory=list)
    resets: int = 0
    #: False: a new connection per request (with several API servers, each may land on any of them)
    keepalive: bool = True

    def __post_init__(self) -> None:
        import httpx

        limits = httpx.Limits() if self.keepalive else httpx.Limits(max_keepalive_connections=0)
        self.http = httpx.Client(base_url=self.url, timeout=self.timeout_s, limits=limits)

    def close(self) -> None:
        self.http.close()

    # ---- raw ---------------------------------------------------------------------------------------------------
    def call(self, method: str, path: str, body: Any = None, *, params: dict[str, Any] | None = None,
             record: bool = True) -> Exchange:
        import httpx

        began = time.perf_counter()
        try:
            r = self.http.request(method, path, json=body, params=params)
        except (httpx.ReadError, httpx.RemoteProtocolError) as e:
            self.resets += 1
            self.log.append(Exchange(method, path, body, -1, f"connection reset: {e!r}", 0.0))
            r = self.http.request(method, path, json=body, params=params)
        try:
            answer: Any = r.json()
        except ValueError:
            answer = r.text
        shown = path + (f"?{httpx.QueryParams(params)}" if params else "")
        ex = Exchange(method, shown, body, r.status_code, answer, (time.perf_counter() - began) * 1000)
        if record:
            self.log.append(ex)
        return ex

    def post(self, path: str, body: Any = None, **params: Any) -> Exchange:
        return self.call("POST", path, body, params=params or None)

    # ---- the RL routes -----------------------------------------------------------------------------------------
    def pause(self, mode: str = "abort") -> Exchange:
        return self.post("/pause", mode=mode)

    def resume(self) -> Exchange:
        return self.post("/resume")

    def is_paused(self) -> bool:
        return bool(self.call("GET", "/is_paused").answer["is_paused"])

    def start_draft(self) -> Exchange:
        return self.post("/start_draft_weight_update")

    def start_policy(self) -> Exchange:
        return self.post("/start_weight_update")

    def update(self, update_info: dict[str, Any]) -> Exchange:
        return self.post("/update_weights", {"update_info": update_info})

    def finish(self, weight_version: str | None = None) -> Exchange:
        return self.post("/finish_weight_update", {} if weight_version is None else {"weight_version": weight_version})

    def weight_version(self) -> str | None:
        answer = self.call("GET", "/weight_info").answer
        return None if answer.get("weight_version") is None else str(answer["weight_version"])

    def push(self, update_info: dict[str, Any], weight_version: str | None = None, *, draft: bool = True,
             pause: str | None = "abort") -> list[Exchange]:
        """One whole push: [pause,] start, update, finish[, resume]. Stops at the first answer that is not 200
        (and still resumes when it paused)."""
        steps: list[Exchange] = []
        if pause:
            steps.append(self.pause(pause))
        for step in (self.start_draft if draft else self.start_policy, lambda: self.update(update_info),
                     lambda: self.finish(weight_version)):
            steps.append(step())
            if not steps[-1].ok:
                break
        if pause:
            steps.append(self.resume())
        return steps

    def weight_checker(self, action: str, baseline: dict[str, str] | None = None) -> Exchange:
        return self.post("/weight_checker", {"action": action, **({"baseline": baseline} if baseline else {})})

    def checksums(self) -> dict[str, str]:
        ex = self.weight_checker("checksum")
        if not ex.ok:
            raise RuntimeError(f"/weight_checker checksum: {ex}")
        return dict(ex.answer["checksums"])

    def take_over(self, push: str) -> Exchange:
        """End the open draft push named `push` ("epoch N", as a refused start names it) at once: the plugin's RPC
        `lifecycle_take_over_push` through `/collective_rpc`."""
        return self.post("/collective_rpc", {"method": "lifecycle_take_over_push", "kwargs": {"push": push}})

    # ---- the dev route ---------------------------------------------------------------------------------------
    def rpc(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """`/collective_rpc` (VLLM_SERVER_DEV_MODE): one answer per worker."""
        ex = self.post("/collective_rpc", {"method": method, "args": list(args), "kwargs": kwargs})
        if not ex.ok:
            raise RuntimeError(f"collective_rpc {method}: {ex}")
        return list(ex.answer["results"])

    # ---- serving ---------------------------------------------------------------------------------------------
    def completion(self, prompt: Sequence[int], max_tokens: int = 12) -> dict[str, Any]:
        """One greedy completion: the first choice (`token_ids`, `finish_reason`)."""
        ex = self.call("POST", "/v1/completions", {
            "model": self.model, "prompt": list(prompt), "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}, record=False)
        if not ex.ok:
            raise RuntimeError(f"/v1/completions: {ex}")
        return dict(ex.answer["choices"][0])

    def stream(self, prompt: Sequence[int], max_tokens: int,
               on_tokens: Callable[[int], None] = lambda n: None,
               opened: Callable[[], None] = lambda: None) -> dict[str, Any]:
        """One greedy completion STREAMED (server-sent events): `opened()` once the answer's headers came,
        `on_tokens(n)` after each chunk that brought
        tokens (n: the tokens received so far). Answers `token_ids` (every delta, joined), `finish_reason` (the
        last chunk's: "length", or "abort" for a request vLLM's pause aborted) and `done` (the `[DONE]` line came:
        the stream ended as vLLM ends it, not cut)."""
        body = {"model": self.model, "prompt": list(prompt), "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True, "return_token_ids": True, "stream": True}
        tokens: list[int] = []
        reason: str | None = None
        done = False
        with self.http.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                raise RuntimeError(f"/v1/completions (stream): {r.status_code} {r.read()[:600]!r}")
            opened()
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    break
                choice = json.loads(line[len("data: "):])["choices"][0]
                reason = choice.get("finish_reason") or reason
                if choice.get("token_ids"):
                    tokens += choice["token_ids"]
                    on_tokens(len(tokens))
        return {"token_ids": tokens, "finish_reason": reason, "done": done}

    def complete(self, prompts: Sequence[Sequence[int]] = PROMPTS, max_tokens: int = 12) -> list[list[int]]:
        """Greedy token ids per prompt, one request after the other."""
        return [list(self.completion(p, max_tokens)["token_ids"]) for p in prompts]

    # ---- /metrics --------------------------------------------------------------------------------------------
    def metrics_text(self) -> str:
        return str(self.call("GET", "/metrics", record=False).answer)

    def metric(self, name: str, **labels: str) -> float:
        """The sum of every sample of `name` on /metrics whose labels include `labels` (prometheus_client's
        own parser); 0.0 when there is none."""
        from prometheus_client.parser import text_string_to_metric_families

        total = 0.0
        for family in text_string_to_metric_families(self.metrics_text()):
            for s in family.samples:
                if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                    total += s.value
        return total
